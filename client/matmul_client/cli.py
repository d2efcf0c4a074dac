"""`matmul-client`: multiply two .npy files on a matmul-service and save the product.

matmul-client a.npy b.npy -o c.npy --kernel tiled --url http://gpu-box:8000
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx
import numpy as np

from matmul_client.client import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    FORMATS,
    MAX_TIMEOUT_S,
    MatmulClient,
    MatmulServiceError,
    Options,
    Product,
)

URL_VARIABLE = "MATMUL_URL"
API_KEY_VARIABLE = "MATMUL_API_KEY"
ZIP_MAGIC = b"PK\x03\x04"
"""How a zip file, hence an .npz archive, begins."""


def _load_operand(path: str, parser: argparse.ArgumentParser) -> np.ndarray:
    """The array of a .npy file. Anything else is refused before np.load, which opens a .npz archive too (an NpzFile of
    named arrays, not an array)."""
    try:
        with open(path, "rb") as file:
            opening = file.read(len(np.lib.format.MAGIC_PREFIX))
        if opening.startswith(ZIP_MAGIC):
            parser.error(f"cannot read {path} as a .npy file: it is a .npz archive; save each operand with np.save")
        if opening != np.lib.format.MAGIC_PREFIX:
            parser.error(f"cannot read {path} as a .npy file: it does not begin with NumPy's magic string")
        # mapped, not read: the file's pages go to the socket as they are
        array: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {path} as a .npy file: {exc}")
    return array


def _seconds(text: str) -> float:
    """A timeout given on the command line: a positive number of seconds, at most MAX_TIMEOUT_S."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds up to {MAX_TIMEOUT_S:.0f}")
    return seconds


def _url(text: str) -> str:
    """The server's URL, given by --url or $MATMUL_URL: http or https, a host, and a port if any from 1 to 65535, in
    ASCII (the Host header carries nothing else: an international domain name goes in its xn-- form)."""
    try:
        parts = urlsplit(text)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # an IPv6 address's [ left open, a port that is not a number or is over 65535
        usable = False
    if not (usable and text.isascii()):
        raise argparse.ArgumentTypeError(
            f"{text!r} (from --url or ${URL_VARIABLE}) is not a server's URL such as {DEFAULT_URL}: http or https, "
            "a host, and a port if any from 1 to 65535, in ASCII"
        )
    return text


def _api_key(text: str) -> str:
    """An API key, given by --api-key or $MATMUL_API_KEY: printable ASCII, all a header carries as the server reads
    it. Never echoed: error messages end up in logs."""
    if not (text.isascii() and text.isprintable()):
        raise argparse.ArgumentTypeError(
            f"the key (from --api-key or ${API_KEY_VARIABLE}; not shown) has a character that is not printable ASCII, "
            "which a header cannot carry"
        )
    return text


def _output(text: str) -> str:
    """Where the product is saved, checked before it is computed: a file that may be written, or a new one in a
    directory that exists and may be written."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name the file to write the product to")
    if not os.path.basename(text):
        raise argparse.ArgumentTypeError(f"{text!r} names no file to write the product to")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: there is no directory {folder!r}")
    if not os.access(text if os.path.exists(text) else folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: permission denied")
    return text


def _summary(product: Product, output: str) -> str:
    tile = f" (tile {product.tile})" if product.tile is not None else ""
    tile += f" in {product.precision}" if product.precision != "fp32" else ""
    phases = ", ".join(f"{name} {ms:.3f}" for name, ms in product.timing.items() if name != "total")
    gflops = f", {product.gflops:.1f} GFLOP/s" if product.gflops is not None else ""
    return (
        f"{output}: {'x'.join(map(str, product.c.shape))} {product.c.dtype} by kernel {product.kernel}{tile} on "
        f"{product.backend} ({product.device}){gflops}\n"
        f"server ms: total {product.timing.get('total', float('nan')):.3f} = {phases}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """matmul-client: C = A @ B computed by a matmul-service, from .npy files to a .npy file."""
    parser = argparse.ArgumentParser(
        prog="matmul-client",
        description="Multiply two .npy matrices on a matmul-service and save the product.",
        epilog="exit status: 0 when the product is saved; 2 for arguments refused before anything is sent; 1 when the "
        "server answers an error or cannot be reached, or the product cannot be written",
    )
    parser.add_argument("a", help="the left operand, a .npy file: a matrix, or a stack of them (3-D)")
    parser.add_argument("b", help="the right operand, a .npy file: a matrix, or a stack of them (3-D)")
    parser.add_argument(
        "-o",
        "--output",
        type=_output,
        required=True,
        help="the file to save the product in, as .npy (no suffix is added)",
    )
    parser.add_argument(
        "--url",
        type=_url,
        default=os.environ.get(URL_VARIABLE, DEFAULT_URL),
        help=f"the server (default: ${URL_VARIABLE}, else {DEFAULT_URL})",
    )
    parser.add_argument("--kernel", help="a kernel the server has (GET /v1/kernels); default: the server's auto")
    parser.add_argument("--tile", type=int, help="tile width, for the tiled kernel")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64", "int32"],
        help="working dtype (default: from the operands; two int8 operands: int32, their exact product)",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "tf32", "3xtf32", "bf16", "fp16", "fp8", "int8"],
        help="how the multiplier rounds float32 operands (default: fp32, as they are; fp8: e4m3, each operand scaled "
        "by a power of two); int8: int8 operands, exactly",
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="npy", help="request body: npy (multipart, the default), json or npz"
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for the answer (default: {DEFAULT_TIMEOUT_S:.0f}, at most {MAX_TIMEOUT_S:.0f}: a day)",
    )
    parser.add_argument(
        "--api-key",
        type=_api_key,
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"sent as a bearer token, for servers with MATMUL_API_KEYS (default: ${API_KEY_VARIABLE})",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    args = parser.parse_args(argv)

    a, b = _load_operand(args.a, parser), _load_operand(args.b, parser)
    options = Options()
    if args.kernel is not None:
        options["kernel"] = args.kernel
    if args.tile is not None:
        options["tile"] = args.tile
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if args.precision is not None:
        options["precision"] = args.precision
    try:
        with MatmulClient(args.url, format=args.format, timeout=args.timeout, api_key=args.api_key) as client:
            product = client.multiply(a, b, **options)
    except ValueError as exc:  # operands the format cannot carry (JSON: NaN and infinities), refused before sending
        parser.error(f"cannot send {args.a} and {args.b} as {args.format}: {exc}")
    except MatmulServiceError as exc:
        where = f" (at {exc.location})" if exc.location else ""
        print(f"matmul-client: the server answered {exc.status} {exc.code}: {exc.message}{where}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"matmul-client: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    try:  # a file object, since np.save adds .npy to a name that does not end with it
        with open(args.output, "wb") as file:
            np.save(file, product.c, allow_pickle=False)
    except OSError as exc:
        print(f"matmul-client: cannot write {args.output}: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(_summary(product, args.output), file=sys.stderr)
    return 0
