"""On a GPU the engine makes a step's outputs while the device runs the next step. Forced on here, on CPU, the
outputs must be what the plain order gives: the same tokens, text, deltas, finish and stop reasons, a stop string
found late dropping the token computed meanwhile, samples of one request ending once, aborts ending at once."""

from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams


def _run(engine, requests, overlap: bool):
    engine._overlap = overlap
    engine.kv.reset_prefix_cache()
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    deltas: dict[tuple[str, int], str] = {}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.delta_index)
            deltas[key] = deltas.get(key, "") + out.delta_text
            if out.finished:
                assert out.request_id not in finals, "a request ended twice"
                finals[out.request_id] = [
                    (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs
                ]
    assert engine.kv.num_used_blocks == 0
    return deltas, finals


@pytest.mark.slow
def test_outputs_made_during_the_next_step_are_the_plain_order_outputs(tiny_chat_model):
    engine = LLM(tiny_chat_model, dtype="float32").engine
    chat = {"messages": [{"role": "user", "content": "Tell me a story about a dragon."}]}
    probe = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    _, ref = _run(engine, [("probe", chat, probe)], overlap=False)
    text = ref["probe"][0][1]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # found mid-way: the request ends early on it
    requests = [
        ("plain", chat, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
        ("stop-string", chat, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])),
        ("samples", chat, SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True)),
        ("eos", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=25, temperature=0.9, seed=4)),
    ]
    plain = _run(engine, requests, overlap=False)
    overlapped = _run(engine, requests, overlap=True)
    assert overlapped == plain
    deltas, finals = plain
    assert finals["stop-string"][0][3:] == ("stop", stop)
    assert [c[0] for c in finals["samples"]] == [0, 1]
    for rid, outs in finals.items():  # each sample's deltas add up to its text
        for index, text, *_ in outs:
            assert deltas[(rid, index)] == text


def test_an_abort_while_outputs_wait_ends_the_request_at_once(tiny_chat_model):
    engine = LLM(tiny_chat_model, dtype="float32").engine
    engine._overlap = True
    engine.add_request("a", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", {"prompt": "What is"}, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    [out] = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    later = []
    while engine.has_unfinished_requests():
        later += engine.step()
    assert all(o.request_id == "b" for o in later)  # nothing more of the aborted request
    assert later[-1].finished and len(later[-1].outputs[0].token_ids) == 8


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_an_abort_takes_in_the_token_whose_output_waits(tiny_chat_model, kind):
    """On a GPU a step's tokens give their outputs at the next step: an abort in between ends the request with
    that token in its text and its deltas, as in its token ids."""
    engine = LLM(tiny_chat_model, dtype="float32").engine
    engine._overlap = True
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, output_kind=kind)
    engine.add_request("a", {"prompt": "Once upon a time"}, params)
    outs = [o for _ in range(6) for o in engine.step()]
    outs += engine.abort_request("a")
    final = outs[-1].outputs[0]
    assert final.finish_reason == "abort" and len(final.token_ids) == 6
    assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
    assert "".join(o.delta_text for o in outs) == final.text == engine.tokenizer.decode(final.token_ids)
    assert not engine.step() and not engine.has_unfinished_requests()


@pytest.mark.slow
def test_an_abort_of_samples_that_ended_at_the_last_step_gives_one_final_output(tiny_chat_model):
    engine = LLM(tiny_chat_model, dtype="float32").engine
    engine._overlap = True
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=1, n=2, ignore_eos=True)
    engine.add_request("g", {"prompt": "Once upon a time"}, params)
    outs = [o for _ in range(3) for o in engine.step()]
    outs += engine.abort_request("g")
    while engine.has_unfinished_requests():
        outs += engine.step()
    [final] = [o for o in outs if o.finished]
    assert [(c.index, c.finish_reason, len(c.token_ids)) for c in final.outputs] == [(0, "length", 3), (1, "length", 3)]


@pytest.mark.slow
def test_an_abort_of_a_request_whose_final_output_waits_gives_that_output(tiny_chat_model):
    """It ended at the last step (its length) and, on a GPU, its final output comes with the next step: an abort in
    between gives it then, whole and with its own finish reason, and the next step gives nothing more of it."""
    engine = LLM(tiny_chat_model, dtype="float32").engine
    engine._overlap = True
    engine.add_request("a", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = [o for _ in range(3) for o in engine.step()]
    assert not any(o.finished for o in outs)
    [final] = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 3
    assert not engine.step() and engine.abort_request("a") == []


def test_a_step_that_fails_still_gives_the_final_outputs_the_step_before_made(tiny_chat_model):
    """On a GPU the outputs of step N are made while step N+1 runs: when N+1 fails, the requests that ended at N
    are not running (the failure is not theirs) and still end, with their outputs; the running ones fail."""
    from worker.pump import Pump

    engine = LLM(tiny_chat_model, dtype="float32").engine
    engine._overlap = True
    pump = Pump(engine, tokenize_in_thread=False)
    pump.submit("short", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=3, ignore_eos=True))
    pump.submit("long", {"prompt": "What is"}, SamplingParams(max_tokens=50, ignore_eos=True))
    events = [e for _ in range(3) for e in pump.step()]
    assert not any(e.finished for e in events)  # "short" ended at step 3; its final output waits

    class Broken:
        def result(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    launch = engine.runner.launch
    engine.runner.launch = lambda sched, masks: (launch(sched, masks), Broken())[1]
    ended = {e.job_id: e for e in pump.step() if e.finished}
    assert ended["short"].finish_reason == "length" and len(ended["short"].output.outputs[0].token_ids) == 3
    assert ended["long"].finish_reason == "error" and ended["long"].retryable
    assert not pump.has_work()


@pytest.mark.slow
def test_a_request_id_whose_final_output_waits_is_still_in_use(tiny_chat_model):
    """On a GPU a request's last output comes a step after its last token: the id is not free until then, or that
    output would go out under the new request's id."""
    engine = LLM(tiny_chat_model, dtype="float32").engine
    engine._overlap = True
    engine.add_request("a", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.step()  # its second token: the request ended, its output waits for the next step
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", {"prompt": "Again"}, SamplingParams(max_tokens=2))
    [final] = [o for o in engine.step() if o.finished]
    assert final.request_id == "a" and len(final.outputs[0].token_ids) == 2
    engine.add_request("a", {"prompt": "Again"}, SamplingParams(max_tokens=2))  # free now
    engine.abort_request("a")


def test_an_interrupt_between_the_schedule_and_the_forward_leaves_no_unwritten_block_to_hit(tiny_chat_model):
    """Ctrl-C (or an error) in the structured-output masks or the schedule, after blocks were put in the prefix
    cache and before the forward filled them: the same prompt again must be computed, not read from those blocks."""
    llm = LLM(tiny_chat_model, dtype="float32")
    engine = llm.engine
    prompt = "Once upon a time there was a little girl who lived in a village near the forest with her mother"
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    [fresh] = llm.generate([prompt], params, use_tqdm=False)
    engine.kv.reset_prefix_cache()
    start_masks = engine.structured.start_masks

    def interrupted(seqs):
        engine.structured.start_masks = start_masks
        raise KeyboardInterrupt

    engine.structured.start_masks = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], params, use_tqdm=False)
    [again] = llm.generate([prompt], params, use_tqdm=False)
    assert len(again.prompt_token_ids) > 2 * engine.kv.block_size  # whole blocks to hit
    assert again.metrics.num_cached_tokens == 0
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def _outputs_through_interrupts(engine):
    """Every output of the engine's steps until it is done, a step an interrupt ended answered by
    ``take_undelivered`` (what it made before the interrupt)."""
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except KeyboardInterrupt:
            outs = engine.take_undelivered()
        yield from outs


@pytest.mark.slow
@pytest.mark.parametrize("where", ["after a token's push", "in a finished request's output"])
def test_an_interrupt_while_outputs_are_made_loses_none_of_them(tiny_chat_model, monkeypatch, where):
    """The previous step's outputs are made inside the next step's try: an interrupt (a signal) midway lost all of
    them, a request that ended there never gave its last output and the others' text missed a token. Those made
    go to ``take_undelivered``, the rest come with the next step; the token in hand is not taken again (its text
    comes with its request's next output), and a request it ended still gets its last output."""
    import roseinfer.detokenizer as detokenizer

    engine = LLM(tiny_chat_model, dtype="float32").engine
    requests = [
        ("short", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
        ("long", {"prompt": "What is"}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
    ]
    plain = _run(engine, requests, overlap=False)
    raised = []
    if where == "after a token's push":
        push = detokenizer.IncrementalDetokenizer.push

        def interrupted(self, token, *args, **kwargs):
            push(self, token, *args, **kwargs)
            if token is not None and not raised and engine.scheduler.get("long") is not None:
                raised.append(token)
                raise KeyboardInterrupt

        monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "push", interrupted)
    else:
        output = type(engine)._output

        def interrupted(self, seq, *args, **kwargs):
            if seq.request_id == "short" and seq.is_finished and not raised:
                raised.append(seq.request_id)
                raise KeyboardInterrupt
            return output(self, seq, *args, **kwargs)

        monkeypatch.setattr(type(engine), "_output", interrupted)
    engine._overlap = True
    engine.kv.reset_prefix_cache()
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    deltas, finals = {}, {}
    for out in _outputs_through_interrupts(engine):
        key = (out.request_id, out.delta_index)
        deltas[key] = deltas.get(key, "") + out.delta_text
        if out.finished:
            finals[out.request_id] = [
                (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs
            ]
    assert raised and finals == plain[1]
    if where == "after a token's push":  # (in the finished one's case its last delta is given up: its final whole)
        assert deltas == plain[0]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_an_interrupt_in_outputs_made_after_the_step_loses_no_last_output_nor_id(tiny_chat_model, monkeypatch, overlap):
    """Outputs made outside the step's try (on a CPU after the step; on a GPU in a call whose schedule is empty,
    every request ended) were lost with an interrupt there: a request that ended in them never gave its last output.
    And a delta's token whose text the detokenizer took before the interrupt came with no id (text and ids apart)."""
    import roseinfer.detokenizer as detokenizer

    engine = LLM(tiny_chat_model, dtype="float32").engine
    delta = {"temperature": 0, "ignore_eos": True, "output_kind": "delta", "logprobs": 1}
    long = 3 if overlap else 8  # (on a GPU both end in one step: the next call's schedule is empty)
    requests = [
        ("a", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=3, **delta)),
        ("b", {"prompt": "What is"}, SamplingParams(max_tokens=long, **delta)),
    ]

    b_detokenizer = []

    def run() -> tuple[dict, dict, dict]:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        b_detokenizer.append(engine.scheduler.get("b").detokenizer)
        texts, ids, finals = {"a": "", "b": ""}, {"a": [], "b": []}, {}
        for out in _outputs_through_interrupts(engine):
            texts[out.request_id] += out.delta_text
            ids[out.request_id] += out.delta_token_ids
            if out.finished:
                finals[out.request_id] = [(c.text, c.token_ids, c.finish_reason) for c in out.outputs]
        return texts, ids, finals

    engine._overlap = overlap
    engine.kv.reset_prefix_cache()
    plain = run()
    push, raised = detokenizer.IncrementalDetokenizer.push, []

    def interrupted(self, token, *args, **kwargs):  # b's token, in the outputs of the step "a" ended in
        push(self, token, *args, **kwargs)
        if token is not None and not raised and engine.scheduler.get("a") is None and self is b_detokenizer[-1]:
            raised.append(token)
            raise KeyboardInterrupt

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "push", interrupted)
    engine.kv.reset_prefix_cache()
    texts, ids, finals = run()
    assert raised and finals == plain[2] and set(finals) == {"a", "b"}
    assert ids == plain[1] and texts == plain[0]
    assert engine.kv.num_used_blocks == 0


def test_a_step_that_fails_after_its_launch_waits_for_the_device_before_the_next(tiny_chat_model, monkeypatch):
    """A step abandoned after its launch (an interrupt while the last step's outputs were made) left its copies of
    the pinned inputs queued on the device; the next step refilled those buffers, and the abandoned decode graph
    could store K/V at another request's slots. The step waits for its own device work before it gives up."""
    engine = LLM(tiny_chat_model, dtype="float32").engine
    engine._overlap = True
    engine.add_request("a", {"prompt": "Once upon a time"}, SamplingParams(max_tokens=6, ignore_eos=True))
    launch, emit, events = engine.runner.launch, type(engine)._emit_pending, []

    def launched(*args, **kwargs):
        pending = launch(*args, **kwargs)
        wait = pending.wait
        pending.wait = lambda: (events.append("waited"), wait())
        events.append("launched")
        return pending

    def interrupted(self, outputs):
        if len(events) == 2:  # the second step's launch: the first's outputs are being made
            raise KeyboardInterrupt
        return emit(self, outputs)

    monkeypatch.setattr(engine.runner, "launch", launched)
    monkeypatch.setattr(type(engine), "_emit_pending", interrupted)
    engine.step()
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert events == ["launched", "launched", "waited"]
