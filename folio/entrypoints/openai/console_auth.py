"""HTTP Basic auth for the web console (the API key as the password, any user name).

A browser that navigates to `/` cannot add a bearer header, but it can answer a Basic
challenge natively and then sends the same credentials on the page's own same-origin fetches.
Basic credentials are the only kind a browser attaches by itself, so they are also the only
kind another site could make it send (a cross-site form POST): a request that a browser marks
as coming from another site is refused whatever its credentials.
"""
from __future__ import annotations

import base64
import binascii
import hmac
from typing import Any
from urllib.parse import urlsplit

REALM = "folio"
# The 401 on the console's pages carries this, so browsers prompt for the key.
CHALLENGE = {"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'}


def basic_password(authorization: str) -> bytes | None:
    """The password of an `Authorization: Basic base64(user:password)` header, or None when
    the header is not well-formed Basic credentials."""
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic" or not encoded:
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    # RFC 7617: the user id holds no colon, the password may.
    user, colon, password = decoded.partition(b":")
    return password if colon else None


def _from_another_site(headers: Any) -> bool:
    """True for a request a browser sent on behalf of another site. Sec-Fetch-Site is set by
    every current browser; Origin covers older ones. Non-browser clients send neither."""
    if headers.get("sec-fetch-site", "").lower() in ("cross-site", "same-site"):
        return True
    origin = headers.get("origin")
    if origin is None:
        return False
    host = headers.get("host", "")
    return origin == "null" or urlsplit(origin).netloc.lower() != host.lower()


def basic_auth_matches(headers: Any, api_key: str) -> bool:
    """Basic credentials whose password is `api_key` (constant-time compare), from the
    console's own origin or a non-browser client."""
    password = basic_password(headers.get("authorization", ""))
    if password is None or _from_another_site(headers):
        return False
    return hmac.compare_digest(password, api_key.encode())


def wants_challenge(path: str) -> bool:
    """The console's page routes, where a 401 should make the browser ask for the key. API
    routes keep their plain 401 (no login dialog for a client's missing key)."""
    return path == "/" or path.startswith("/console/")
