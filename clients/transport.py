"""What a failed connection says about the port's transport, so the error names the fix.

gRPC reports a plaintext client on a TLS port only as ``Socket closed``, and a TLS client on a
plaintext port as a handshake failure deep in its message. When a connection fails, the
clients ask ``Transport.explain``: it reads gRPC's message and, where that is not enough,
tries one TLS handshake with the port itself (no certificate checked, nothing sent after
it), and returns a TransportMismatchError that says "this port speaks TLS: pass
--tls-root-cert" (or the reverse, or that the certificate is not trusted, or that the port does
not speak gRPC at all). A gRPC port without the inference service (the adapter store's) is named too.
"""

from __future__ import annotations

import re
import socket
import ssl
from dataclasses import dataclass

import grpc

from loraplex.clients.errors import LoraplexClientError, TransportMismatchError

CONNECT_FAILURE = "failed to connect to all addresses"
PLAINTEXT_ON_TLS = ("this port speaks TLS: pass --tls-root-cert CA.pem, the CA that signed the server's certificate "
                    "(--tls alone for a publicly trusted one; env LORAPLEX_TLS_ROOT_CERT; in Python "
                    "tls=TlsConfig(root_cert_file=...))")
TLS_ON_PLAINTEXT = ("this port speaks plaintext gRPC, not TLS: leave out --tls and --tls-root-cert "
                    "(env LORAPLEX_TLS_ROOT_CERT; in Python tls=None)")
UNTRUSTED = ("the server's TLS certificate is not one this client trusts (not signed by the CA given, or not "
             "naming this address): pass the CA that signed it with --tls-root-cert (env LORAPLEX_TLS_ROOT_CERT) "
             "and dial a name the certificate lists")
NO_CLIENT_CERT = ("this server requires a client certificate (mutual TLS): pass --tls-client-cert CERT.pem "
                  "--tls-client-key KEY.pem (env LORAPLEX_TLS_CLIENT_CERT / LORAPLEX_TLS_CLIENT_KEY; in Python "
                  "TlsConfig(client_cert_file=..., client_key_file=...))")
HTTP_NOT_GRPC = ("this port does not speak gRPC (it answered in something other than HTTP/2: an HTTP/1.1 port, such "
                 "as the server's OpenAI --http-port?): dial the server's gRPC port, its --port (default 50051)")
NOT_INFERENCE_SERVICE = ("this port speaks gRPC but serves no loraplex.v1.InferenceService (the adapter store's "
                         "port? another service?): dial the server's gRPC port, its --port (default 50051)")
CLIENT_CERT_REFUSED = ("the server refused this client's certificate: it is not signed by a CA the server trusts "
                       "for clients (its --tls-client-ca-file), or it has expired")
_UNTRUSTED_MARKS = ("CERTIFICATE_VERIFY_FAILED", "certificate signature failure", "Peer name")
_HOST_PORT = re.compile(r"\A(?:ipv4:|ipv6:|dns:(?:///)?)?\[?([^\[\]/]+?)\]?:(\d+)\Z")


@dataclass(frozen=True, slots=True)
class Transport:
    """How a client dials ``address``: over TLS or plaintext, with a client certificate or not."""

    address: str
    tls: bool
    client_pair: tuple[str, str] | None = None  # the client certificate and key files (mutual TLS)

    def explain(self, error: LoraplexClientError) -> LoraplexClientError:
        """``error``, or a TransportMismatchError naming the fix when the connection failed
        because the client and the port speak different transports."""
        if error.code == grpc.StatusCode.UNIMPLEMENTED and "Method not found" in error.details:
            return LoraplexClientError(error.code, f"{NOT_INFERENCE_SERVICE} ({error.details})")
        hint = self.hint(error)
        if hint is None:
            return error
        return TransportMismatchError(error.code, f"{hint} ({error.details})")

    def hint(self, error: LoraplexClientError) -> str | None:
        """The fix for a connection failure caused by the transport, or None."""
        details = error.details
        if error.code != grpc.StatusCode.UNAVAILABLE or CONNECT_FAILURE not in details:
            return None
        closed = "Socket closed" in details or "Connection reset" in details
        if "Failed parsing HTTP/2" in details:  # the port answered gRPC's connection preface in another protocol
            return HTTP_NOT_GRPC
        if self.tls:
            if closed and refuses_client(self.address, self.client_pair):  # a session ended over the client's cert
                return CLIENT_CERT_REFUSED if self.client_pair else NO_CLIENT_CERT
            if "handshake failed" not in details.lower():
                return None
            if speaks_tls(self.address) is False:
                return TLS_ON_PLAINTEXT
            return UNTRUSTED if any(mark in details for mark in _UNTRUSTED_MARKS) else None
        if closed:
            return PLAINTEXT_ON_TLS if speaks_tls(self.address) else None
        return None


def refuses_client(address: str, client_pair: tuple[str, str] | None, timeout_s: float = 2.0) -> bool | None:
    """Does the TLS server at ``address`` end the session over the client's certificate (with
    ``client_pair`` None: over having none)? A server that accepts it sends its HTTP/2 settings
    after the handshake; one that does not closes the session (TLS 1.3: after the handshake, with
    or without an alert; TLS 1.2: in it). None when the port cannot be reached or the address is
    not host:port."""
    m = _HOST_PORT.match(address)
    if m is None:
        return None
    host, port = m[1], int(m[2])
    context = _probe_context()
    try:
        if client_pair is not None:
            context.load_cert_chain(*client_pair)
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host if not host[0].isdigit() else None) as tls:
            return tls.recv(1) == b""  # b"": closed at once; data: the server's first frame
    except ssl.SSLError as e:
        return "ALERT" in str(e.reason or e).upper()
    except TimeoutError:  # nothing sent: not an alert
        return False
    except OSError:
        return None


def _probe_context() -> ssl.SSLContext:
    """A TLS client context that checks no certificate: the probes ask only what the port speaks."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


def speaks_tls(address: str, timeout_s: float = 2.0) -> bool | None:
    """Does the port at ``address`` (host:port) answer a TLS handshake? None when it cannot be
    reached or the address is not host:port. The server's certificate is not checked: this only
    asks which protocol the port speaks."""
    m = _HOST_PORT.match(address)
    if m is None:
        return None
    host, port = m[1], int(m[2])
    context = _probe_context()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host if not host[0].isdigit() else None):
            return True
    except ssl.SSLError as e:  # an alert is TLS too (e.g. a server that requires a client certificate)
        return "ALERT" in str(e.reason or e).upper()
    except OSError:
        return None
