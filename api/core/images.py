"""Images sent in a request, read and checked by the api before anything queues (Pillow; no torch).

An image arrives as a data URL (`data:image/png;base64,...`) in every API's image part. Each is
decoded once, whole, on a thread of its own (never on the event loop): PNG, JPEG, WebP, and a GIF
(its first frame). What is refused, each a 4xx naming why and which image:
- more images than `image_max_images` in one request (400), more bytes than `image_max_bytes` in
  one image (413), more pixels than `image_max_pixels` (400, read from the header before the pixels
  are decoded: a decompression bomb is refused unopened);
- bytes that are no PNG, JPEG, WebP or GIF (random bytes, SVG, ...), a truncated or corrupt file
  (400: the whole image is decoded, so a cut one is found here, not in a worker);
- an `http(s)` URL, unless its host is on the operator's allow-list (api/core/image_urls.py says
  how it is fetched: public addresses only, checked on every redirect, size and time caps).

A checked image is named by the sha256 of its bytes, so the same image sent twice is one.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

from api.core import image_urls
from api.core.errors import ApiError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?((?:;[A-Za-z0-9=.+-]+)*?);base64,", re.IGNORECASE)


@dataclass(frozen=True)
class Limits:
    max_images: int = 16
    max_bytes: int = 20 * 2**20
    max_pixels: int = 25_000_000
    url_hosts: str = ""  # the hosts images are fetched from (STREAMQ_IMAGE_URL_HOSTS); empty: none
    url_timeout_s: float = 10.0

    @classmethod
    def of(cls, settings) -> Limits:
        """The api's settings' (STREAMQ_IMAGE_*)."""
        return cls(settings.image_max_images, settings.image_max_bytes, settings.image_max_pixels,
                   settings.image_url_hosts, settings.image_url_timeout_s)


@dataclass(frozen=True)
class Image:
    """A checked image: its bytes as sent, their sha256, its format and size."""

    data: bytes
    sha256: str
    format: str
    width: int
    height: int


def data_of(url: str, where: str, limits: Limits, param: str = "messages") -> bytes:
    """The bytes of an image part's URL (a base64 data URL); ApiError naming `where` otherwise."""
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}: an image needs a URL (a data URL: data:image/png;base64,...)", param=param)
    if url[:8].lower().startswith(("http://", "https://")):
        raise ApiError(400, f"{where}: image URLs are not fetched by this server; send the image as a data URL "
                            "(data:image/png;base64,...)", param=param)  # (check_all fetches allowed hosts')
    match = _DATA_URL.match(url)
    if match is None:
        raise ApiError(400, f"{where}: not a base64 data URL of an image (data:image/png;base64,...)", param=param)
    encoded = url[match.end():]
    if len(encoded) > (limits.max_bytes + 2) // 3 * 4 + 4:
        raise ApiError(413, f"{where}: the image is larger than {limits.max_bytes} bytes", param=param)
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: the data URL is not valid base64", param=param) from None


def check(data: bytes, where: str, limits: Limits, param: str = "messages") -> Image:
    """`data` decoded whole and checked (ApiError naming `where` when it is refused)."""
    from PIL import Image as Pil
    from PIL import UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ApiError(413, f"{where}: the image is larger than {limits.max_bytes} bytes", param=param)
    try:
        with Pil.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ApiError(400, f"{where}: the image has {width}×{height} pixels, more than the "
                                    f"{limits.max_pixels} allowed", param=param)
            kind = image.format
            image.seek(0)  # a GIF's or an animated WebP's first frame
            image.load()
    except ApiError:
        raise
    except Pil.DecompressionBombError:  # Pillow's own guard, far above ours: refused at open
        raise ApiError(400, f"{where}: the image has more than the {limits.max_pixels} pixels allowed",
                       param=param) from None
    except UnidentifiedImageError:
        raise ApiError(400, f"{where}: not an image this server reads (PNG, JPEG, WebP or GIF)",
                       param=param) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ApiError(400, f"{where}: the image cannot be decoded ({_reason(exc)})", param=param) from None
    return Image(data, hashlib.sha256(data).hexdigest(), kind, width, height)


async def check_all(urls: list[tuple[str, str]], limits: Limits, param: str = "messages") -> list[Image]:
    """Each (where, url) read and checked, off the event loop; ApiError (naming the body's field
    `param`) on the first refused."""
    if len(urls) > limits.max_images:
        raise ApiError(400, f"{len(urls)} images in one request; at most {limits.max_images} are taken",
                       param=param)
    hosts = image_urls.AllowedHosts(limits.url_hosts)
    blobs = []
    for where, url in urls:
        if hosts and isinstance(url, str) and url[:8].lower().startswith(("http://", "https://")):
            data = await image_urls.fetch(url, where, hosts, limits.max_bytes, limits.url_timeout_s, param)
        else:
            data = data_of(url, where, limits, param)
        blobs.append((where, data))
    return list(await asyncio.to_thread(lambda: [check(data, where, limits, param) for where, data in blobs]))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."
