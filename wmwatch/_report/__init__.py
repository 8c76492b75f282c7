"""``wmwatch report``: queries over the history file, and their rendering."""
