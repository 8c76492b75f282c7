"""Pushgateway mode against a real Pushgateway that asks for basic auth, TLS and a client
certificate (its ``--web.config.file``), with certificates made by openssl: what is pushed with
the right options is kept, every wrong one is refused and counted, and no password or
credential-bearing address reaches the log."""

from __future__ import annotations

import base64
import logging
import socket
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness.metrics import progress, samples, watched_registry
from tests.harness.net import free_port, self_signed_cert
from tests.prom_servers import Probe, pushgateway
from wmwatch._errors import ConfigError
from wmwatch._metrics.push import PushPlugin

USER = "wmwatch"
PASSWORD = "push-s3cret"
# bcrypt of PASSWORD at cost 4 (the least the Pushgateway accepts, so each check is quick),
# made with: python3.11 -c "import crypt; print(crypt.crypt('push-s3cret',
#     crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)))"
PASSWORD_BCRYPT = "$2b$04$6Mcmk4ycYhvsi7PU5SXeG.EtrebsdOUALoHFCRKnKP./UjI0CGIaO"
WRONG_PASSWORD = "not-the-push-password"


def authorization(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def kept_by(url: str, probe: Probe) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    request = urllib.request.Request(f"{url}/metrics", headers=probe.headers)
    with urllib.request.urlopen(request, timeout=5, context=probe.context) as response:
        return samples(response.read().decode())


def refused(plugin: PushPlugin) -> str:
    """Push once now and once at close; both must fail. Returns the error."""
    assert not plugin.push_now()
    plugin.close()
    assert plugin.pushes_total == 0 and plugin.push_errors_total == 2
    assert plugin.last_error is not None
    return plugin.last_error


def groups(kept: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    """The jobs the gateway holds a push for."""
    return {dict(labels)["job"] for name, labels in kept if name == "push_time_seconds"}


def test_basic_auth_is_required_and_accepted_by_a_real_pushgateway(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    book, registry = watched_registry()
    book.on_progress(progress(7))
    probe = Probe(headers=authorization(USER, PASSWORD))
    config = {"basic_auth_users": {USER: PASSWORD_BCRYPT}}
    caplog.set_level(logging.DEBUG, logger="wmwatch")
    with pushgateway(tmp_path, config, probe) as url:
        assert "401" in refused(PushPlugin(registry, url, job="anonymous"))
        assert "401" in refused(
            PushPlugin(registry, url, job="wrong", basic_auth=(USER, WRONG_PASSWORD))
        )
        accepted = PushPlugin(registry, url, job="nightly", basic_auth=(USER, PASSWORD))
        assert accepted.push_now()
        accepted.close()
        kept = kept_by(url, probe)
    assert accepted.push_errors_total == 0
    assert groups(kept) == {"nightly"}
    assert kept[("wmwatch_watermark_seconds", (
        ("instance", ""), ("job", "nightly"), ("query", "orders"),
    ))] == pytest.approx(1767225607.0)  # fmt: skip
    assert "401" in caplog.text  # the failure is logged, the passwords are not
    assert PASSWORD not in caplog.text and WRONG_PASSWORD not in caplog.text


def test_tls_with_a_private_ca_and_a_client_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "client").mkdir()
    cert, key = self_signed_cert(tmp_path / "server")
    client_cert, client_key = self_signed_cert(tmp_path / "client")
    config = {
        "tls_server_config": {
            "cert_file": str(cert),
            "key_file": str(key),
            "client_auth_type": "RequireAndVerifyClientCert",
            "client_ca_file": str(client_cert),
        },
        "basic_auth_users": {USER: PASSWORD_BCRYPT},
    }
    context = ssl.create_default_context(cafile=str(cert))
    context.load_cert_chain(str(client_cert), str(client_key))
    probe = Probe(context=context, headers=authorization(USER, PASSWORD))
    book, registry = watched_registry()
    book.on_progress(progress(7))
    tls: dict[str, Any] = {
        "basic_auth": (USER, PASSWORD),
        "cafile": str(cert),
        "certfile": str(client_cert),
        "keyfile": str(client_key),
    }
    caplog.set_level(logging.DEBUG, logger="wmwatch")
    with pushgateway(tmp_path, config, probe) as url:
        # a plain-HTTP client gets nothing from the TLS port
        with pytest.raises(OSError):
            urllib.request.urlopen(url.replace("https", "http") + "/-/ready", timeout=5)
        without_ca = {**tls, "cafile": None}  # the system's CAs do not know this certificate
        assert "CERTIFICATE_VERIFY_FAILED" in refused(
            PushPlugin(registry, url, job="untrusted", **without_ca)
        )
        without_client_cert = {**tls, "certfile": None, "keyfile": None}
        refused(PushPlugin(registry, url, job="anonymous", **without_client_cert))
        wrong_password = {**tls, "basic_auth": (USER, WRONG_PASSWORD)}
        assert "401" in refused(PushPlugin(registry, url, job="wrong", **wrong_password))

        # host:port with TLS options is https
        address = url.removeprefix("https://")
        accepted = PushPlugin(registry, address, job="nightly", **tls)
        assert accepted.gateway == url
        assert accepted.push_now()
        accepted.close()
        kept = kept_by(url, probe)
    assert accepted.pushes_total == 2 and accepted.push_errors_total == 0
    assert groups(kept) == {"nightly"}
    assert kept[("wmwatch_watermark_seconds", (
        ("instance", ""), ("job", "nightly"), ("query", "orders"),
    ))] == pytest.approx(1767225607.0)  # fmt: skip
    assert PASSWORD not in caplog.text and WRONG_PASSWORD not in caplog.text


@pytest.mark.parametrize(
    ("gateway", "options", "message"),
    [
        ("http://h:9091", {"cafile": "ca.pem"}, "need an https:// Pushgateway"),
        ("https://prom:pw@h:9091", {}, "credentials in push_basic_auth"),
        ("prom:pw@h:9091", {}, "credentials in push_basic_auth"),
        ("h:9091", {"certfile": "c.pem"}, "both push_certfile and push_keyfile"),
        ("h:9091", {"basic_auth": ("prom", "")}, "non-empty"),
        ("h:9091", {"cafile": "/nonexistent/ca.pem"}, "cannot load the Pushgateway TLS files"),
    ],
)
def test_misconfigured_auth_and_tls_are_one_config_error(
    gateway: str, options: dict[str, Any], message: str
) -> None:
    _, registry = watched_registry()
    with pytest.raises(ConfigError, match=message) as info:
        PushPlugin(registry, gateway, **options)
    assert "\n" not in str(info.value) and "pw@" not in str(info.value)


@pytest.mark.spark
def test_attach_passes_the_push_options_and_frees_its_port_when_they_are_wrong(
    spark: Any, tmp_path: Path
) -> None:
    import wmwatch

    (tmp_path / "server").mkdir()
    cert, key = self_signed_cert(tmp_path / "server")
    config = {
        "tls_server_config": {"cert_file": str(cert), "key_file": str(key)},
        "basic_auth_users": {USER: PASSWORD_BCRYPT},
    }
    probe = Probe(
        context=ssl.create_default_context(cafile=str(cert)),
        headers=authorization(USER, PASSWORD),
    )
    port = free_port()
    with pytest.raises(ConfigError, match="cannot load the Pushgateway TLS files"):
        wmwatch.attach(
            spark, db=tmp_path / "h.duckdb", metrics_port=port, pushgateway="127.0.0.1:1",
            push_cafile=str(tmp_path / "missing.pem"), inspect_plans=False,
        )  # fmt: skip
    with socket.socket() as again:  # the failed attach left the port free
        again.bind(("127.0.0.1", port))
    with pushgateway(tmp_path, config, probe) as url:
        watch = wmwatch.attach(
            spark, db=None, metrics_port=None, pushgateway=url.removeprefix("https://"),
            push_job="attached", push_basic_auth=(USER, PASSWORD), push_cafile=str(cert),
            inspect_plans=False,
        )  # fmt: skip
        watch.close()  # pushes once more
        kept = kept_by(url, probe)
    (plugin,) = [p for p in watch.plugins() if isinstance(p, PushPlugin)]
    assert plugin.pushes_total == 1 and plugin.push_errors_total == 0
    assert groups(kept) == {"attached"}
