"""The engine reads a checkpoint's tensors itself, never building transformers' model: each family and rotary type
still matches transformers' greedy output, in every file layout, and a checkpoint that lacks a tensor is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy
from safetensors.torch import load_file, save_file

from roseinfer import LLM, SamplingParams
from roseinfer.config import ConfigError

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPTS = [[5, 17, 200, 3, 99], list(range(40, 80)), [7] * 12]
_SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "initializer_range": 0.3, "eos_token_id": None, "bos_token_id": None}  # fmt: skip


def _config(family: str, **extra):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
               "smollm3": SmolLM3Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config,
               "gemma2": Gemma2Config, "granite": GraniteConfig, "mixtral": MixtralConfig,
               "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig, "olmo2": Olmo2Config}  # fmt: skip
    return classes[family](**{**_SMALL, **extra})


def _save(config, path: Path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers starts norms at one and biases at zero: a swapped one would go unseen
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


def _engine_greedy(path: str, **options) -> list[list[int]]:
    llm = LLM(path, dtype="float32", **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


FAMILIES = {
    "qwen2 (q/k/v biases)": ("qwen2", {}),
    "qwen3 (q/k norms, wide heads)": ("qwen3", {"head_dim": 32}),
    "llama3 rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "yarn rope": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 64}}),
    "linear rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama, every bias, tied head": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                                               "hidden_act": "gelu_pytorch_tanh"}),
    "mistral": ("mistral", {}),
    "smollm3 (a layer without rotation)": ("smollm3", {"no_rope_layer_interval": 2, "pad_token_id": None}),
    # Phi-4-mini's: three quarters of each head rotated, LongRoPE (its short factors, within 64 positions).
    "phi3 (fused weights, partial rotation, longrope)": ("phi3", {
        "pad_token_id": None, "original_max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64, "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.1],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}}),
    # Each of its four multipliers away from one.
    "granite (multipliers)": ("granite", {"embedding_multiplier": 3.0, "attention_multiplier": 0.1,
                                          "residual_multiplier": 0.5, "logits_scaling": 4.0, "pad_token_id": None}),
    # Four experts, two a token, renormalized; Qwen3-MoE's upper layer with experts, its lower one dense.
    "mixtral (experts)": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
                                      "pad_token_id": None}),
    "qwen3_moe (experts, a dense layer)": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                                         "moe_intermediate_size": 48, "decoder_sparse_step": 2,
                                                         "norm_topk_prob": False, "pad_token_id": None}),
    # Experts beside a shared expert every token runs, weighed by its sigmoid gate; q/k/v biases; a dense layer.
    "qwen2_moe (experts, a shared expert, a dense layer)": ("qwen2_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": False, "pad_token_id": None}),
    # Norms after attention and the MLP, q and k normed over their whole projections.
    "olmo2": ("olmo2", {"pad_token_id": None}),
    # Sliding and full layers by turns, scores capped at 2 (tight enough to change them) and logits at 3.
    "gemma2": ("gemma2", {"num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "pad_token_id": None}),
    # A Gemma fine-tune with a head of its own: the embedding served as the head, its logits wrong without a word.
    "gemma2, its own head": ("gemma2", {"num_hidden_layers": 2, "head_dim": 32, "tie_word_embeddings": False,
                                        "pad_token_id": None}),
    # Two sliding layers (window 6, rotary base 10,000) then a full one (base 1,000,000, linear scaling).
    "gemma3": ("gemma3", {"num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
                          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                 "rope_theta": 1000000.0}},
                          "pad_token_id": None}),
}  # fmt: skip
FAST = ("qwen2 (q/k/v biases)", "qwen3 (q/k norms, wide heads)", "llama3 rope")


@pytest.mark.parametrize(
    "case", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in FAMILIES]
)
def test_each_family_matches_transformers(case, tmp_path):
    """Greedy tokens, and every prompt token's logprob: a random tiny model's next token may hang on its last
    token's embedding alone, where a wrong rotary base or attention scale leaves the greedy tokens as they were."""
    family, extra = FAMILIES[case]
    path = _save(_config(family, **extra), tmp_path / "model")
    assert _engine_greedy(path) == hf_greedy(path, PROMPTS, 16)
    assert _prompt_logprobs_gap(path, PROMPTS[1]) < 1e-4


@pytest.mark.slow
def test_a_gemma3_vision_language_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3's 4B and larger checkpoints hold a vision tower beside the text model (``language_model.model.*``):
    the engine serves the text model for text prompts, as transformers' model of the whole answers them."""
    from transformers import Gemma3Config

    text = FAMILIES["gemma3"][1]
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = Gemma3Config(text_config={**_SMALL, **text}, vision_config=vision, mm_tokens_per_image=1)
    path = _save(config, tmp_path / "model")
    assert _engine_greedy(path) == hf_greedy(path, PROMPTS, 16)
    assert _prompt_logprobs_gap(path, PROMPTS[1]) < 1e-4


def _prompt_logprobs_gap(path: str, prompt: list[int]) -> float:
    """The largest difference between the engine's and transformers' logprob of each prompt token (float32)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(path, dtype="float32", max_num_batched_tokens=16)  # prefilled in chunks
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = [next(iter(d.values())) for d in out[0].prompt_logprobs[1:]]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    theirs = [lp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    return max(abs(a - b) for a, b in zip(ours, theirs))


INT8_FAST = ("qwen2 (q/k/v biases)", "qwen2_moe (experts, a shared expert, a dense layer)")


@pytest.mark.parametrize(
    "case", [name if name in INT8_FAST else pytest.param(name, marks=pytest.mark.slow) for name in FAMILIES]
)
def test_each_family_runs_in_int8_and_scores_text_near_its_float_model(case, tmp_path):
    """``quantization="int8"`` on every family: each dense layer (experts, shared experts, fused and biased
    projections) multiplies in int8, the output layer and the routers in float, and the prompt's tokens score near
    the float model's scores (these random models' logits are large: a relative gap)."""
    from roseinfer.models.linear import Linear
    from roseinfer.quantization import dense_layers

    family, extra = FAMILIES[case]
    path = _save(_config(family, **extra), tmp_path / "model")
    prompt = {"prompt_token_ids": PROMPTS[1]}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scores = []
    for quantization in (None, "int8"):
        llm = LLM(path, dtype="float32", quantization=quantization)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        scores.append([next(iter(d.values())) for d in out.prompt_logprobs[1:]])
    model = llm.engine.model
    layers = dense_layers(model)
    assert layers and all(layer._qweight is not None for layer in layers)
    floats = [v for v in _objects(model) if isinstance(v, Linear) and v._qweight is None]
    assert model.lm_head in floats and all(v is model.lm_head or v.out_features <= 4 for v in floats)  # routers
    expert_gates = [v.shared_expert_gate for v in _objects(model) if getattr(v, "shared_expert_gate", None)]
    assert all(gate in floats for gate in expert_gates) and bool(expert_gates) == ("a shared expert" in case)
    gap = sum(abs(a - b) for a, b in zip(*scores)) / sum(abs(a) for a in scores[0])
    assert 0 < gap < 0.05, gap


def _objects(model) -> list:
    """Every object the model holds, through its own objects, lists and tuples."""
    found, todo, seen = [], [model], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found.append(obj)
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("roseinfer.models"):
            todo.extend(vars(obj).values())
    return found


def test_which_qwen3_moe_layers_have_experts():
    """transformers' rule: none without experts; else every ``decoder_sparse_step``-th but the dense-only ones."""
    from transformers import Qwen3MoeConfig

    from roseinfer.models.moe import is_sparse_layer

    layers = {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [is_sparse_layer(Qwen3MoeConfig(**layers), i) for i in range(4)] == [False, True, False, False]
    assert not any(is_sparse_layer(Qwen3MoeConfig(**layers, num_experts=0), i) for i in range(4))


WINDOWED = {
    "mistral, every layer": ("mistral", {"sliding_window": 6}),
    "qwen2, the upper layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "phi3": ("phi3", {"sliding_window": 6, "pad_token_id": None}),
    "gemma2, capped scores": FAMILIES["gemma2"],
    "qwen3, heads of 64": ("qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0,
                                     "head_dim": 64}),
    # Every layer slides (its config has no layer_types): each attended over the whole context.
    "qwen3_moe, every layer": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                             "norm_topk_prob": False, "pad_token_id": None,
                                             "use_sliding_window": True, "sliding_window": 6}),
}  # fmt: skip


WINDOWED_FAST = ("qwen3, heads of 64", "c")


@pytest.mark.parametrize(
    ("case", "kernels"),
    [pytest.param(case, kernels, marks=() if (case, kernels) == WINDOWED_FAST else pytest.mark.slow)
     for case in WINDOWED for kernels in ("c", "torch")],
)  # fmt: skip
def test_sliding_window_layers_match_transformers_past_the_window(case, kernels, tmp_path, monkeypatch):
    """Prompts and outputs far longer than a window of 6 keys, which starts inside a KV block of 8 and moves
    across blocks; long prompts prefilled in chunks of 16, so a window also reaches back into earlier chunks."""
    import roseinfer.kernels

    if kernels == "torch":
        monkeypatch.setenv("ROSEINFER_CPU_KERNELS", "0")
        monkeypatch.setattr(roseinfer.kernels, "_tried", False)
        monkeypatch.setattr(roseinfer.kernels, "_lib", None)
    family, extra = WINDOWED[case]
    path = _save(_config(family, **extra), tmp_path / "model")
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.attn_backend.name == ("cpu-kernels" if kernels == "c" else "torch")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, 16)


def _peak_blocks(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """The outputs of ``prompts`` run at once, and the most KV blocks in use after any step."""
    engine, outs, peak = llm.engine, {}, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        peak = max(peak, engine.kv.num_used_blocks)
    return [outs[str(i)] for i in range(len(prompts))], peak


def test_blocks_out_of_every_layers_window_are_freed_as_requests_go_on(tmp_path):
    """Where every layer slides (Mistral, a window of 6 in blocks of 8), a request holds only the blocks its window
    and its step's tokens reach: four requests of 60 tokens run at once in a pool of 12 blocks without a
    preemption, token for token as transformers. Kept whole, they preempt one another in the same pool."""
    path = _save(_config("mistral", sliding_window=6), tmp_path / "model")
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(path, dtype="float32", kv_cache_memory="48KiB", max_num_batched_tokens=16)
    assert (llm.engine.kv.num_blocks, llm.engine.kv.sliding_window) == (12, 6)
    outputs, peak = _peak_blocks(llm, prompts, params)
    assert outputs == hf_greedy(path, prompts, 40)
    assert llm.engine.scheduler.num_preemptions == 0 and peak <= 12
    assert llm.engine.kv.num_used_blocks == 0  # every block back, the dropped ones counted once
    whole = LLM(path, dtype="float32", kv_cache_memory="48KiB", max_num_batched_tokens=16)
    whole.engine.kv.sliding_window = 0
    assert _peak_blocks(whole, prompts, params)[0] == outputs and whole.engine.scheduler.num_preemptions > 0


def test_a_model_with_full_layers_frees_nothing_out_of_its_windows(tmp_path):
    """Gemma 2's full layers read every key, and Qwen2's lower layers too: no block is freed."""
    from roseinfer.models import kv_window

    for case in ("gemma2, capped scores", "qwen2, the upper layer"):
        family, extra = WINDOWED[case]
        llm = LLM(_save(_config(family, **extra), tmp_path / case), dtype="float32")
        assert kv_window(llm.engine.model) == 0 == llm.engine.kv.sliding_window, case


def test_the_rotary_tables_are_transformers_own(tmp_path):
    """Of every rotary type the engine takes, the cos/sin it tabulates are those transformers' rotary embedding
    computes, to the bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from roseinfer.models.llama import rope_frequencies

    for case in ("llama3 rope", "yarn rope", "linear rope", "mistral"):
        config = _config(FAMILIES[case][0], **FAMILIES[case][1])
        hf = LlamaRotaryEmbedding(config)
        inv_freq, scaling = rope_frequencies(config)
        assert torch.equal(inv_freq, hf.inv_freq), case
        assert scaling == hf.attention_scaling, case


def test_sharded_and_pytorch_checkpoints_load_the_same_weights(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    expected = _engine_greedy(tiny_llama)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(sharded, max_shard_size="40KB")
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _engine_greedy(str(sharded)) == expected

    pytorch = tmp_path / "pytorch"
    shutil.copytree(tiny_llama, pytorch)
    torch.save(load_file(pytorch / "model.safetensors"), pytorch / "pytorch_model.bin")
    (pytorch / "model.safetensors").unlink()
    assert _engine_greedy(str(pytorch)) == expected


def test_a_folder_saved_again_in_the_other_layout_loads_the_weights_transformers_loads(tiny_llama, tmp_path):
    """save_pretrained leaves the other layout's files: the index of sharded weights beside a single file saved
    later (refused: "names a shard which is not there"), or a single file beside shards saved later (served, with
    other weights than transformers' own). transformers takes the single file first, and now so does the engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    other = AutoModelForCausalLM.from_config(model.config)  # (random weights of its own)
    stale_index = tmp_path / "stale-index"
    other.save_pretrained(stale_index, max_shard_size="40KB")
    for shard in stale_index.glob("model-*.safetensors"):
        shard.unlink()  # (a shard removed since, as a re-save into a clean copy leaves it)
    model.save_pretrained(stale_index)
    assert (stale_index / "model.safetensors.index.json").is_file()
    expected = _engine_greedy(tiny_llama)
    assert _engine_greedy(str(stale_index)) == expected

    both = tmp_path / "both"
    other.save_pretrained(both, max_shard_size="40KB")
    shutil.copy(Path(tiny_llama) / "model.safetensors", both / "model.safetensors")
    assert _engine_greedy(str(both)) == expected


def test_gpt2_names_without_the_transformer_prefix_load(tiny_gpt2, tmp_path):
    """The hub's original GPT-2 checkpoints name their tensors ``h.0.attn...``; saved by transformers today,
    ``transformer.h.0.attn...``."""
    bare = tmp_path / "gpt2-bare"
    shutil.copytree(tiny_gpt2, bare)
    tensors = load_file(bare / "model.safetensors")
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()}, bare / "model.safetensors")
    assert _engine_greedy(str(bare)) == _engine_greedy(tiny_gpt2)


def test_a_checkpoint_that_lacks_a_tensor_or_cannot_be_read_is_refused(tiny_llama, tmp_path):
    """transformers fills a missing weight with random numbers and warns; the engine refuses to serve them. A tensor
    of another shape than the config's (weights beside another model's config) is refused at load, not found by
    every request's first step. A file it cannot read is a ConfigError naming it, not a traceback."""
    path = tmp_path / "incomplete"
    shutil.copytree(tiny_llama, path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"no tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        LLM(str(path), dtype="float32")

    save_file(load_file(tiny_llama + "/model.safetensors"), path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))  # another model's config
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\], where "
                       r"its config calls for \[96, 64\]"):  # fmt: skip
        LLM(str(path), dtype="float32")
    (path / "config.json").write_text(json.dumps(config))

    (path / "model.safetensors").write_bytes(b"not a checkpoint" * 8)  # a truncated or mangled download
    with pytest.raises(ConfigError, match=r"cannot load model .*: cannot read .*model\.safetensors: SafetensorError"):
        LLM(str(path), dtype="float32")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not a checkpoint" * 8)
    with pytest.raises(ConfigError, match=r"cannot read .*pytorch_model\.bin"):
        LLM(str(path), dtype="float32")
    (path / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match=r"holds no weights: no model\.safetensors, pytorch_model\.bin"):
        LLM(str(path), dtype="float32")

    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"names model-00001-of-00002\.safetensors, which is not there"):
        LLM(str(path), dtype="float32")


def test_a_hub_id_loads_from_the_local_hub_cache(tiny_llama, tmp_path, monkeypatch):
    import huggingface_hub.constants

    repo = tmp_path / "cache" / "models--acme--tiny"
    shutil.copytree(tiny_llama, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    llm = LLM("acme/tiny", dtype="float32")
    assert llm.engine.model_path == str(repo / "snapshots" / "0123abcd")
    with pytest.raises(ConfigError, match="cannot load model 'acme/absent'"):
        LLM("acme/absent", dtype="float32")


def test_a_hub_download_takes_only_the_weight_files_the_engine_reads(tiny_llama, tmp_path, monkeypatch):
    """A repository may hold its weights twice (Mistral's consolidated.safetensors beside its shards, PyTorch files
    beside safetensors): the download takes the shards its index names, once."""
    import fnmatch

    import huggingface_hub
    from transformers import AutoModelForCausalLM

    remote = tmp_path / "remote"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(remote, max_shard_size="40KB")
    shards = json.loads((remote / "model.safetensors.index.json").read_text())["weight_map"].values()
    shutil.copy(remote / sorted(shards)[0], remote / "consolidated.safetensors")
    (remote / "pytorch_model.bin").write_bytes(b"a second copy")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        assert repo_id == "acme/tiny"
        for file in remote.iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, snapshot / file.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert _engine_greedy("acme/tiny") == _engine_greedy(tiny_llama)
    taken = {file.name for file in snapshot.iterdir()}
    assert set(shards) <= taken and not {"consolidated.safetensors", "pytorch_model.bin"} & taken


@pytest.mark.slow
def test_an_engine_starts_without_transformers_modeling_code(tiny_llama):
    """Importing a transformers model class (torch._dynamo, torch.distributed, scipy) took seconds of every
    worker's start: the engine builds its layers from the checkpoint alone."""
    code = (
        "import re, sys; from roseinfer import LLM; LLM(sys.argv[1], dtype='float32'); "
        r"print(sorted(m for m in sys.modules if re.match(r'transformers\.models\.(?!auto\.)\w+\.modeling_', m)))"
    )
    out = subprocess.run([sys.executable, "-c", code, tiny_llama], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _write_tiny_llama_gguf(path: Path, arch: str = "llama", seed: int = 0) -> None:
    """A 2-layer random Llama (or Qwen3, Phi-3, Gemma 2 or 3: q/k norms, Phi's fused tensors, Gemma's post-norms
    and tied output) as llama.cpp writes one: its names, its metadata, a byte-level BPE vocabulary."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = [chr(c) for c in range(ord("a"), ord("a") + 26)] + ["ab", "abc", "<|end|>"]
    hidden, ffn, heads, kv_heads, vocab = 32, 64, 4, 2, len(tokens)
    # transformers reads no head size from a Qwen3 GGUF: it takes Qwen3's own, 128.
    head_dim = {"qwen3": 128, "gemma3": 16}.get(arch, hidden // heads)
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in [("add_context_length", 128), ("add_embedding_length", hidden), ("add_block_count", 2),
                       ("add_feed_forward_length", ffn), ("add_head_count", heads), ("add_head_count_kv", kv_heads),
                       ("add_layer_norm_rms_eps", 1e-5), ("add_rope_freq_base", 10000.0),
                       ("add_vocab_size", vocab), ("add_key_length", head_dim),
                       ("add_value_length", head_dim)]:  # fmt: skip
        getattr(writer, add)(value)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b", "ab c"])
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 1)  # (transformers' Phi-3 config would take 32,000, past this vocabulary)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
              "attn_output": (hidden, q), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}  # fmt: skip
    if arch == "phi3":  # q/k/v in one tensor, gate and up in another
        shapes = {"attn_qkv": (q + 2 * kv, hidden), "attn_output": (hidden, q), "ffn_up": (2 * ffn, hidden),
                  "ffn_down": (hidden, ffn)}  # fmt: skip
    norms = {"attn_norm": hidden, "ffn_norm": hidden}
    if arch in ("qwen3", "gemma3"):
        norms |= {"attn_q_norm": head_dim, "attn_k_norm": head_dim}
    if arch in ("gemma2", "gemma3"):
        norms |= {"post_attention_norm": hidden, "post_ffw_norm": hidden}
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    for i in range(2):
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        for name, size in norms.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", 1 + weight(size))
    writer.add_tensor("output_norm.weight", 1 + weight(hidden))
    if arch not in ("gemma2", "gemma3"):
        writer.add_tensor("output.weight", weight(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_greedy_matches_transformers(llm: LLM, path: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[1, 2, 3], [5, 5, 7, 20, 1], list(range(26))]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
        assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_a_gguf_of_another_family_matches_transformers(arch, tmp_path, monkeypatch):
    """Qwen3, Phi-3, Gemma 2 and 3 GGUF files, as llama.cpp names their tensors, converted through transformers like
    the default model's."""
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_llama_gguf(path, arch)
    llm = LLM(str(path), dtype="float32")
    assert type(llm.engine.runner.model).__name__ == ("Gemma" if arch.startswith("gemma") else "Llama")
    _gguf_greedy_matches_transformers(llm, path)


def test_a_gguf_is_converted_from_its_own_file_alone(tmp_path, monkeypatch):
    """transformers took a bare file name from the working folder first: a GGUF of the same name there gave its
    weights to the conversion (cached under this file's name, served so from then on). And it read tokenizer files
    beside a GGUF over the file's own: with no end token, refused, naming an upgrade that could not help."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    _write_tiny_llama_gguf(tmp_path / "here" / "model.gguf", seed=1)
    path = tmp_path / "there" / "model.gguf"
    _write_tiny_llama_gguf(path)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=str(path)).save_pretrained(path.parent)
    monkeypatch.chdir(tmp_path / "here")
    _gguf_greedy_matches_transformers(LLM(str(path), dtype="float32"), path)


def test_a_conversion_in_the_cache_cut_short_is_converted_again(tmp_path, monkeypatch):
    """A converted file cut short or emptied behind a whole folder (a crash after its rename, before the disk had
    it) failed every start after with "cannot read ... model.safetensors", and was never converted again."""
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    _write_tiny_llama_gguf(path)
    LLM(str(path), dtype="float32")
    [weights] = (tmp_path / "cache").glob("*/model.safetensors")
    for cut in (weights.stat().st_size - 100, 0):
        with weights.open("r+b") as file:
            file.truncate(cut)
        _gguf_greedy_matches_transformers(LLM(str(path), dtype="float32"), path)


@pytest.mark.slow
def test_a_gguf_is_converted_with_one_parse_and_matches_transformers(tmp_path, monkeypatch):
    """transformers parsed the file four times and built gguf's name map once per submodule (58 s of the default
    model's first load here, 23 s now). The conversion parses once, restores gguf's functions, and the engine on
    the converted folder matches transformers' greedy output on the GGUF file itself."""
    import gguf

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    _write_tiny_llama_gguf(path)
    parses = []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs) -> None:
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    name_map = gguf.get_tensor_name_map
    llm = LLM(str(path), dtype="float32")
    assert len(parses) == 1
    assert gguf.GGUFReader is CountedReader and gguf.get_tensor_name_map is name_map
    _gguf_greedy_matches_transformers(llm, path)


def test_a_gguf_whose_tokenizer_transformers_reads_with_another_end_token_is_refused(tmp_path, monkeypatch):
    """transformers before 5.18 read SmolLM2's GGUF tokenizer with ``<|im_start|>`` as its end token: the
    conversion compares the end token with the file's and refuses, naming the fix, before the cache holds a model
    whose structured outputs end aborted."""
    import transformers

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    _write_tiny_llama_gguf(path)
    read = transformers.AutoTokenizer.from_pretrained

    def misread(*args, **kwargs):
        tokenizer = read(*args, **kwargs)
        assert tokenizer.eos_token == "<|end|>"  # what the file names, read right by this transformers
        tokenizer.eos_token = "a"
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", misread)
    refused = r"end token 'a' \(id 0\) where the file names id 28: install transformers>=5\.18"
    with pytest.raises(ConfigError, match=refused):
        LLM(str(path), dtype="float32")
    assert not any((tmp_path / "cache").glob("*/config.json"))


def test_a_bias_is_read_exactly_where_the_config_gives_the_layer_one(tmp_path):
    """A Qwen2 checkpoint without its q/k/v biases (transformers always has them) loaded with zeros in their place:
    wrong text without a word. A Mistral checkpoint holding biases its model has none of (transformers leaves them
    unused) had them added to every projection."""
    path = Path(_save(_config("qwen2"), tmp_path / "qwen2"))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"no tensor 'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        LLM(str(path), dtype="float32")

    path = Path(_save(_config("mistral"), tmp_path / "mistral"))
    tensors = load_file(path / "model.safetensors")
    for i in range(_config("mistral").num_hidden_layers):  # (biases a converter left in)
        tensors[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.full((_config("mistral").hidden_size,), 3.0)
    save_file(tensors, path / "model.safetensors")
    outs = LLM(str(path), dtype="float32").generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(path), PROMPTS, 16)


@pytest.mark.slow  # three conversions
def test_a_gguf_converted_by_an_older_roseinfer_is_converted_again(tmp_path, monkeypatch):
    """A converted folder was never checked again: one written before the end-token check (transformers before 5.18
    made SmolLM2's end token <|im_start|>) was served on every later start. A folder without this conversion's
    mark, or made from another source, is converted again and replaced."""
    from roseinfer.model_loader import CONVERSION_MARK, convert_gguf

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    _write_tiny_llama_gguf(path)
    folder = convert_gguf(path, "tiny", source="one")
    mark = json.loads((folder / CONVERSION_MARK).read_text())
    assert mark["source"] == "one" and json.loads((folder / "tokenizer_config.json").read_text())["eos_token"]
    (folder / CONVERSION_MARK).unlink()  # as an older roseinfer left it, with its wrong end token
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    assert convert_gguf(path, "tiny", source="one") == folder
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|end|>"
    written = (folder / "config.json").stat().st_mtime_ns
    assert convert_gguf(path, "tiny", source="one") == folder  # marked now: read as it is
    assert (folder / "config.json").stat().st_mtime_ns == written
    convert_gguf(path, "tiny", source="two")  # (an upgrade of the package that ships the file)
    assert json.loads((folder / CONVERSION_MARK).read_text())["source"] == "two"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".tiny.lock", "tiny"]
    # On a cache that cannot be written (a read-only volume), a folder without this mark is served as it is.
    (folder / CONVERSION_MARK).unlink()
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert convert_gguf(path, "tiny", source="two") == folder and not (folder / CONVERSION_MARK).exists()


def test_a_cache_write_removes_what_a_killed_writer_left_and_keeps_the_umasks_modes(tmp_path, monkeypatch):
    """A writer killed midway (its clean-up never ran) left its folder, hundreds of megabytes, for good; the next
    writer of that name removes it, and no other name's. ``mkdtemp``'s folder was 0700: another user (a service
    account, a cache filled at the image's build) could not read the model."""
    from roseinfer import model_loader
    from roseinfer.model_loader import save_in_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(cache))
    for leftover in (".m.part-k3j9x0a_", ".m.old-abcdefgh", ".m-other.part-abcdefgh", ".mm.part-abcdefgh"):
        (cache / leftover).mkdir(parents=True)
        (cache / leftover / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(model_loader, "_UMASK", 0o022)  # (the process's, read at import)
    folder = save_in_cache("m", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert sorted(p.name for p in cache.iterdir()) == [".m-other.part-abcdefgh", ".m.lock", ".mm.part-abcdefgh", "m"]
    assert (folder.stat().st_mode & 0o777, (folder / "config.json").stat().st_mode & 0o777) == (0o755, 0o644)


def test_a_tokenizer_folder_named_that_holds_no_tokenizer_is_refused(tiny_llama, tmp_path):
    """Named on purpose, a folder with no tokenizer files was taken for "no tokenizer": the engine started without
    the model's end token, and every text prompt failed later ("this model has no tokenizer")."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"cannot load tokenizer .*empty.*: the folder holds none of tokenizer\.json"):
        LLM(tiny_llama, tokenizer=str(tmp_path / "empty"), dtype="float32")


def test_workers_starting_together_convert_a_model_once_and_all_get_the_whole_folder(tmp_path, monkeypatch):
    """The first writes the cache's folder; the others wait for it instead of each converting a copy."""
    import threading
    import time

    from roseinfer.model_loader import save_in_cache

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    saves = []

    def save(folder: Path) -> None:
        saves.append(folder)
        time.sleep(0.3)  # a conversion takes a while: the others start meanwhile
        (folder / "config.json").write_text("{}")

    got = []
    threads = [threading.Thread(target=lambda: got.append(save_in_cache("m", save))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(saves) == 1
    assert got == [tmp_path / "cache" / "m"] * 3 and (got[0] / "config.json").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == ["m"]


@pytest.mark.slow  # two Python processes
def test_processes_starting_together_on_a_gguf_convert_it_once(tmp_path):
    """The lock was taken only around the cache's write: each process still spent the whole conversion (minutes
    for a large model) for a folder only the first one's rename kept."""
    path = tmp_path / "tiny-llama.gguf"
    _write_tiny_llama_gguf(path)
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from roseinfer.model_loader import resolve_model\n"
        f"print(resolve_model({str(path)!r}))\n"
    )
    env = {**os.environ, "ROSEINFER_CACHE_DIR": str(tmp_path / "cache")}
    run = [sys.executable, "-c", code]
    procs = [subprocess.Popen(run, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    outs = [proc.communicate(timeout=240) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1 and Path(outs[0][0].strip(), "config.json").is_file()
    assert sum("(once)" in err for _, err in outs) == 1  # one conversion; the other waited for its folder
