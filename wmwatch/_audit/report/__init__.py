"""The audit's part of ``wmwatch report``: the late-rows section (``section``) and its series for
the HTML charts (``series``)."""
