"""Incremental detokenization on the default model's byte-level tokenizer."""

import pytest

from roseinfer import detokenizer
from roseinfer.detokenizer import IncrementalDetokenizer
from roseinfer.sampling_params import SamplingParams


@pytest.fixture(autouse=True, params=["decode-stream", "window"])
def decode_path(request, monkeypatch):
    """Every test on both paths: tokenizers' DecodeStream, and the windowed decode other tokenizers take."""
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "DecodeStream", None)
    return request.param


TEXTS = [
    "Hello 👋🏽 world 🎉!",  # emoji with a skin-tone modifier: many bytes, split over tokens
    "東京は日本の首都です。北京欢迎你",  # CJK
    "Cafe\u0301 nai\u0308ve Zoe\u0308 — a\u0323\u0302",  # combining marks
    "plain ascii, spaces  and\nnewlines",
]


def stream(tok, text, params=None, prompt="Say:"):
    ids = tok.encode(text)
    prompt_ids = tok.encode(prompt)
    d = IncrementalDetokenizer(tok, prompt_ids, params or SamplingParams())
    pieces = []
    for _i, t in enumerate(ids):
        piece = d.update(t)
        assert "\ufffd" not in piece  # never half a character
        pieces.append(piece)
        if d.stop_hit:
            break
    pieces.append(d.finish())
    return ids, pieces, d


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_full_decode(smol_tokenizer, text):
    ids, pieces, d = stream(smol_tokenizer, text)
    assert "".join(pieces) == smol_tokenizer.decode(ids) == d.output_text
    assert len(ids) > 4


def test_multibyte_characters_wait_for_their_last_token(smol_tokenizer):
    ids, pieces, _ = stream(smol_tokenizer, "🎉")
    assert len(ids) > 1  # the emoji really spans tokens
    assert pieces[:-1].count("") >= 1 and "".join(pieces) == "🎉"


def test_stop_string_split_across_tokens_is_held_back_and_cut(smol_tokenizer):
    text = "The answer is forty-two. THE END and more text"
    params = SamplingParams(stop=["THE END"])
    _ids, pieces, d = stream(smol_tokenizer, text, params)
    assert d.stop_hit == "THE END"
    assert d.output_text == "The answer is forty-two. "
    assert "".join(pieces) == d.output_text
    assert not any("THE" in p for p in pieces)  # the start of the stop string was never shown


def test_each_stop_string_is_looked_for_where_it_could_end_in_the_new_text(smol_tokenizer):
    """All were searched from where the longest could begin: one of 200,000 characters beside the others had every
    one searched through the whole output at every token (4,000 tokens: 2.1 s against 0.3 s). Matches are the same.
    (A stop string is held to 1,024 characters now: the longest taken stands beside the short one here.)"""
    long = "never " * 170
    _, pieces, d = stream(smol_tokenizer, "a b c STOP d", SamplingParams(stop=[long, "STOP"]))
    assert (d.stop_hit, d.output_text, "".join(pieces)) == ("STOP", "a b c ", "a b c ")
    _, _, d = stream(smol_tokenizer, "a never never b", SamplingParams(stop=[long, "r b"]))
    assert (d.stop_hit, d.output_text) == ("r b", "a never neve")


def test_stop_string_kept_when_asked(smol_tokenizer):
    _, pieces, d = stream(smol_tokenizer, "a b c STOP d", SamplingParams(stop="STOP", include_stop_str_in_output=True))
    assert d.output_text == "a b c STOP" and "".join(pieces) == "a b c STOP"


def test_text_that_may_begin_a_stop_string_kept_in_the_output_is_not_held_back(smol_tokenizer):
    """Held back as if it might be cut (vLLM holds nothing back then): a stop string kept in the output never cuts
    what came before it, so each token's text streams at once."""
    params = SamplingParams(stop=["The answer is wrong, stop now"], include_stop_str_in_output=True)
    ids, pieces, d = stream(smol_tokenizer, " The answer is fine.", params)
    assert pieces[:-1] == [
        smol_tokenizer.decode(ids[: i + 1])[len(smol_tokenizer.decode(ids[:i])) :] for i in range(len(ids))
    ]
    assert d.stop_hit is None and "".join(pieces) == " The answer is fine."
    _, pieces, d = stream(smol_tokenizer, "a b STOP c", SamplingParams(stop="STOP", include_stop_str_in_output=True))
    assert d.output_text == "".join(pieces) == "a b STOP"


def test_partial_match_that_never_completes_is_released(smol_tokenizer):
    _, pieces, d = stream(smol_tokenizer, "we say THE EN and stop there", SamplingParams(stop=["THE END"]))
    assert d.stop_hit is None
    assert "".join(pieces) == "we say THE EN and stop there"


def test_a_character_cut_off_by_the_end_still_comes_out(smol_tokenizer, decode_path):
    ids = smol_tokenizer.encode("ok 🎉")
    d = IncrementalDetokenizer(smol_tokenizer, smol_tokenizer.encode("Say:"), SamplingParams())
    assert (d._stream is not None) == (decode_path == "decode-stream")
    pieces = [d.update(t) for t in ids[:-1]]  # the emoji's last byte never arrives
    pieces.append(d.finish())
    assert "".join(pieces) == smol_tokenizer.decode(ids[:-1]) == d.output_text
    assert pieces[-1].endswith("\ufffd")


def test_a_prompt_of_token_ids_that_ends_inside_a_character_leaks_none_of_its_text(smol_tokenizer):
    """Token ids cut anywhere may end a prompt inside an emoji: the output's first tokens complete it. The output
    is that emoji and what follows, never the prompt's words before it (a stop string in those words ends nothing)."""
    ids = smol_tokenizer.encode("a story about the party 🎉 and more")
    cut = next(i for i in range(1, len(ids)) if smol_tokenizer.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]
    _, pieces, d = stream_ids(smol_tokenizer, prompt, output, SamplingParams(stop=["about"]))
    assert d.stop_hit is None
    assert "".join(pieces) == d.output_text == " 🎉 and more"  # the held token is " " and the emoji's first byte


def test_a_prompt_cut_inside_a_character_gives_no_text_to_an_output_that_made_none(smol_tokenizer, decode_path):
    """Its held bytes were flushed at the end though no output token came (aborted while waiting), or only one with
    no text (EOS first): the output's text was " \ufffd", the prompt's space and half an emoji. vLLM's is ""."""
    ids = smol_tokenizer.encode("the party 🎉")
    cut = next(i for i in range(1, len(ids)) if smol_tokenizer.decode(ids[:i]).endswith("\ufffd"))
    eos = smol_tokenizer.eos_token_id
    for output in ([], [eos]):
        _, pieces, d = stream_ids(smol_tokenizer, ids[:cut], output, SamplingParams())
        assert "".join(pieces) == d.output_text == ""
    _, pieces, d = stream_ids(smol_tokenizer, ids[:cut], ids[cut:], SamplingParams())  # completed: the emoji
    assert d.output_text.endswith("🎉") and "\ufffd" not in d.output_text


def stream_ids(tok, prompt_ids, ids, params):
    d = IncrementalDetokenizer(tok, prompt_ids, params)
    pieces = [d.update(t) for t in ids]
    pieces.append(d.finish())
    return ids, pieces, d


def test_a_stop_string_ends_nothing_before_min_tokens(smol_tokenizer):
    text = "STOP one two STOP three"
    ids = smol_tokenizer.encode(text)
    first_stop_tokens = len(smol_tokenizer.encode("STOP"))
    assert len(ids) > first_stop_tokens + 3
    # Before min_tokens the first STOP is plain text; the second one, past min_tokens, ends the output.
    _, pieces, d = stream(smol_tokenizer, text, SamplingParams(stop="STOP", min_tokens=first_stop_tokens + 1))
    assert (d.stop_hit, d.output_text, "".join(pieces)) == ("STOP", "STOP one two ", "STOP one two ")
    # One that lies in the text of the first min_tokens tokens never ends it (vLLM's rule, as for a stop id).
    _, _, d = stream(smol_tokenizer, text, SamplingParams(stop="STOP", min_tokens=first_stop_tokens))
    assert (d.stop_hit, d.output_text) == ("STOP", "STOP one two ")


def test_a_stop_string_across_the_min_tokens_boundary_still_ends_the_output(smol_tokenizer):
    """Begun in the text of the first min_tokens tokens and ended after it, it matches (as in vLLM): only one lying
    wholly before the boundary does not."""
    for min_tokens in (0, 1):
        _, pieces, d = stream(
            smol_tokenizer, "Hello world again", SamplingParams(stop="lo world", min_tokens=min_tokens)
        )
        assert (d.stop_hit, d.output_text, "".join(pieces)) == ("lo world", "Hel", "Hel"), min_tokens


@pytest.mark.parametrize("min_tokens", range(1, 8))
def test_text_handed_out_before_min_tokens_is_never_cut_by_a_stop_string(smol_tokenizer, min_tokens):
    """A stop string shorter than another one, lying in text handed out before min_tokens: the search for stop
    strings once min_tokens are out reached back into it and cut the output behind what had been streamed."""
    params = SamplingParams(stop=["answer", "x" * 15], min_tokens=min_tokens)
    _, pieces, d = stream(smol_tokenizer, "The answer is 42. The end", params)
    assert "".join(pieces) == d.output_text


def test_a_slow_tokenizer_is_told_whether_to_space_special_tokens(decode_path):
    """vLLM's ``spaces_between_special_tokens`` reaches the decode of a tokenizer without a Rust backend (a fast one
    puts no spaces there whatever it is told)."""

    told = set()

    class SlowTokenizer:  # decodes token i as one letter; says how it was asked to
        def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
            told.add(spaces_between_special_tokens)
            return "".join(chr(97 + i % 26) for i in ids)

    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    d = IncrementalDetokenizer(SlowTokenizer(), [1, 2], params)
    assert d.update(3) + d.update(4) + d.finish() == "de" and told == {False}


def _byte_fallback_tokenizer():
    """A Llama 2 / Mistral style tokenizer: Metaspace words, unknown characters as <0xNN> byte tokens, decoded by
    ByteFallback (bytes that are no UTF-8 become U+FFFD, each)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({"▁wizard": 259, "▁said": 260})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_bytes_that_are_no_utf8_under_a_byte_fallback_decoder_do_not_stop_the_request():
    """A newline, then the first two bytes of a 4-byte emoji, then a word: the bytes are no UTF-8, the decoder turns
    all three into U+FFFD, and the text already handed out changes. tokenizers' DecodeStream raised "Invalid
    prefix" out of the engine's step, at every step after (vLLM's issue 17448)."""
    tok = _byte_fallback_tokenizer()
    ids = tok.convert_tokens_to_ids(["<0x0A>", "<0xF0>", "<0x9F>", "▁wizard", "▁said"])
    d = IncrementalDetokenizer(tok, tok.convert_tokens_to_ids(["<s>", "▁said"]), SamplingParams())
    text = "".join(d.update(t) for t in ids) + d.finish()
    assert text.endswith(" wizard said") and text.count("\ufffd") >= 2  # the request goes on, as decode renders it


def test_a_prompt_ending_in_byte_tokens_gives_the_output_its_characters_under_a_byte_fallback_decoder():
    """A prompt ending in characters the vocabulary lacks ("我爱你": nine byte tokens), an output going on in them:
    the context, the prompt's last 5 tokens, began inside a character, and ByteFallback rendered that run of bytes
    as U+FFFD, the output's bytes with it ("你好" came out as nine U+FFFD). The context starts on a character."""
    tok = _byte_fallback_tokenizer()
    prompt = [tok.bos_token_id, *tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in "我爱你".encode()])]
    output = tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in "你好".encode()])
    _, pieces, d = stream_ids(tok, prompt, output, SamplingParams())
    assert "".join(pieces) == d.output_text == "你好"
    # Ending inside a character too (its first byte given with the prompt): the output completes it.
    _, pieces, d = stream_ids(tok, prompt + output[:1], output[1:], SamplingParams())
    assert "".join(pieces) == "你好"
