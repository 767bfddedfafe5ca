"""Image references in requests -> encoded image bytes: data URLs, bare base64 (SGLang's `image_data`),
and, where the operator allows it, http(s) URLs fetched with a size and a time limit. The worker decodes
the bytes (a bad image is its INVALID_ARGUMENT, 400 here). Sizes are checked here, where the request says
where each image is, by the frontend's rule (frontend/validate.py)."""

from __future__ import annotations

import base64
import binascii
import re

import httpx

from ..frontend.validate import image_size_problem
from .errors import HttpError

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]*/?[\w.+-]*)(?P<params>(?:;[^,;]*)*),(?P<data>.*)", re.S)


class ImageLoader:
    def __init__(self, max_bytes: int, allow_urls: bool, timeout_s: float):
        self.max_bytes = max_bytes
        self.allow_urls = allow_urls
        self.timeout_s = timeout_s

    async def load(self, ref: str, where: str, *, bare_base64: bool = False) -> bytes:
        """The bytes `ref` names; 400 (naming `where`) when it is malformed, too large or cannot be fetched."""
        ref = ref.strip()
        if ref.startswith("data:"):
            return self._data_url(ref, where)
        if ref.startswith(("http://", "https://")):
            if not self.allow_urls:
                raise HttpError.invalid(f"{where}: this server does not fetch image URLs; send the image as a "
                                        "data URL (data:image/png;base64,...)")
            return await self._fetch(ref, where)
        if bare_base64:
            return self._checked(_b64(ref, where), where)
        raise HttpError.invalid(f"{where}: an image is a data URL (data:image/png;base64,...)"
                                + (" or an http(s) URL" if self.allow_urls else ""))

    def _data_url(self, ref: str, where: str) -> bytes:
        m = _DATA_URL.fullmatch(ref)
        if m is None or ";base64" not in m["params"]:
            raise HttpError.invalid(f"{where}: a data URL must be base64-encoded (data:image/png;base64,...)")
        return self._checked(_b64(m["data"], where), where)

    async def _fetch(self, url: str, where: str) -> bytes:
        chunks, size = [], 0
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=True,
                                         max_redirects=3) as client, client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise HttpError.invalid(f"{where}: fetching {url} returned HTTP {response.status_code}")
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise HttpError.invalid(f"{where}: the image at {url} is larger than "
                                                f"{self.max_bytes} bytes")
                    chunks.append(chunk)
        except httpx.TimeoutException:
            raise HttpError.invalid(f"{where}: fetching {url} took longer than {self.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise HttpError.invalid(f"{where}: cannot fetch {url}: {e}") from None
        return self._checked(b"".join(chunks), where)

    def _checked(self, data: bytes, where: str) -> bytes:
        if problem := image_size_problem(f"{where}: the image", data, self.max_bytes, in_mib=False):
            raise HttpError.invalid(problem)
        return data


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise HttpError.invalid(f"{where}: the image is not valid base64") from None
