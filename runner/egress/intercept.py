"""TLS interception: an ephemeral CA per call.

To put a credential into an HTTPS request, or to hold it to the methods its rule grants, the
proxy must see the request: for hosts that have a credential or a method-restricted rule it
terminates the sandbox's TLS with a certificate for that host, signed by a CA made for this
call alone, then speaks TLS to the real upstream (verified against the system's CAs and the
operator's ``egress_ca_file``). The CA's certificate is trusted inside this call's sandbox only
(a bundle in ``/in`` named by ``SSL_CERT_FILE`` and friends); its private key exists only in
this process's memory and dies with the call. Other hosts are tunnelled untouched: the sandbox
talks TLS to them end to end. A tool that trusts only its own CAs (certificate pinning) cannot
reach an intercepted host: that fails closed.
"""

from __future__ import annotations

import dataclasses
import datetime
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from runner.base import InputFile, SandboxSpec
from runner.errors import SandboxError

CA_INPUT = "stockade-ca.pem"
_SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_BUNDLE_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class InterceptCA:
    """One call's CA, and the server contexts it signs for the hosts the proxy intercepts."""

    def __init__(self) -> None:
        now = datetime.datetime.now(datetime.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _name("stockade per-call CA")
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self._name).issuer_name(self._name).public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )  # fmt: skip
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)
        self._contexts: dict[str, ssl.SSLContext] = {}

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for ``host`` signed by this CA."""
        if host not in self._contexts:
            now = datetime.datetime.now(datetime.UTC)
            key = ec.generate_private_key(ec.SECP256R1())
            cert = (
                x509.CertificateBuilder()
                .subject_name(_name(host)).issuer_name(self._name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256())
            )  # fmt: skip
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            # ssl loads chains from files only; the directory is private and gone at once.
            with tempfile.TemporaryDirectory() as scratch:
                chain = Path(scratch) / "chain.pem"
                private = key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
                chain.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + private)
                context.load_cert_chain(chain)
            self._contexts[host] = context
        return self._contexts[host]


def upstream_context(extra_ca: Path | None) -> ssl.SSLContext:
    """How the proxy verifies an upstream it terminated TLS for: the system's CAs, plus the operator's."""
    context = ssl.create_default_context()
    if extra_ca is not None:
        context.load_verify_locations(cafile=str(extra_ca))
    return context


def needs_interception(spec: SandboxSpec) -> bool:
    """Whether the proxy must see inside this call's HTTPS: to inject a credential, or to check
    methods against a rule that restricts them."""
    return bool(spec.injections) or any(rule.methods for rule in spec.egress)


def with_interception(spec: SandboxSpec) -> tuple[SandboxSpec, InterceptCA | None]:
    """``spec`` prepared for interception: a fresh CA, and its certificate (with the system's
    CAs, so other hosts still verify) trusted inside the sandbox. Unchanged when nothing needs it.

    Raises:
        SandboxError: an input of the caller's takes the bundle's name (`CA_INPUT`). Refused on
            every call, not only those intercepted, so whether a name works never depends on egress.
    """
    if any(item.name == CA_INPUT for item in spec.inputs):
        raise SandboxError(
            f"input file name {CA_INPUT!r} is reserved for stockade's egress CA bundle: rename the input"
        )
    if not needs_interception(spec):
        return spec, None
    ca = InterceptCA()
    system = _SYSTEM_BUNDLE.read_bytes() if _SYSTEM_BUNDLE.is_file() else b""
    bundle = InputFile(CA_INPUT, ca.cert_pem + b"\n" + system)
    env = {**spec.env, **dict.fromkeys(_BUNDLE_ENV, f"/in/{CA_INPUT}")}
    return dataclasses.replace(spec, inputs=(*spec.inputs, bundle), env=env), ca
