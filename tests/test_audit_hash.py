"""The audit's keyed hash, without Spark: the pads the executors use give RFC 2104's HMAC, and the
key comes from the option or the environment."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from wmwatch._audit.replay.engine import hmac_pads
from wmwatch._audit.start import resolve_hash_key
from wmwatch._errors import ConfigError


@pytest.mark.parametrize(
    "key", [b"k", b"\x00secret\xff", "clé".encode(), b"x" * 64, b"y" * 65, b"z" * 200]
)
def test_pads_give_hmac_sha256(key: bytes) -> None:
    pads = hmac_pads(key)
    for message in (b"", b"alice@example.com", "ünï".encode() * 50):
        # what the executors compute: sha2(outer || unhex(sha2(inner || m)))
        inner = hashlib.sha256(pads.inner + message).digest()
        ours = hashlib.sha256(pads.outer + inner).hexdigest()
        assert ours == hmac.new(key, message, hashlib.sha256).hexdigest()
    assert key.hex() not in repr(pads) and pads.inner.hex() not in repr(pads)


def test_hash_key_from_option_or_environment() -> None:
    assert resolve_hash_key(None, None) is None
    assert resolve_hash_key(b"\x01k", "from-env") == b"\x01k"  # the option wins
    assert resolve_hash_key("clé", None) == "clé".encode()
    assert resolve_hash_key(None, "from-env") == b"from-env"
    with pytest.raises(ConfigError, match="hash_key is empty"):
        resolve_hash_key(b"", "from-env")
    with pytest.raises(ConfigError, match=r"\$WMWATCH_HASH_KEY is empty"):
        resolve_hash_key(None, "")
    with pytest.raises(ConfigError, match="bytes or a str"):
        resolve_hash_key(1234, None)  # type: ignore[arg-type]  # a wrong type, on purpose
