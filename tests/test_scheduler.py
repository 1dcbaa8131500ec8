from roseinfer.block_manager import KVCacheManager
from roseinfer.sampler import SamplerOutput
from roseinfer.sampling_params import SamplingParams
from roseinfer.scheduler import Scheduler
from roseinfer.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32):
    kv = KVCacheManager(num_blocks, block_size)
    return kv, Scheduler(kv, max_seqs, budget)


def add(sched, rid, n):
    s = Sequence(rid, [hash((rid, i)) % 1000 for i in range(n)], SamplingParams(), None, None)
    sched.add(s)
    return s


def run_step(sched):
    """What the engine does around the forward: token 1 sampled for every request that samples."""
    out = sched.schedule()
    num_samples = sum(item.samples for item in out.scheduled)
    sched.update_from_output(out, SamplerOutput([1] * num_samples, [None] * num_samples), now=0.0)
    return out


def test_admission_respects_max_num_seqs_and_the_token_budget():
    _, sched = make(max_seqs=2, budget=100)
    for i in range(4):
        add(sched, f"r{i}", 10)
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_long_prompt_is_chunked_and_decodes_go_first():
    _, sched = make(budget=16)
    short = add(sched, "short", 5)
    run_step(sched)  # short prefilled
    long = add(sched, "long", 40)
    out = run_step(sched)
    assert out.scheduled[0].seq is short and out.scheduled[0].num_tokens == 1
    assert out.scheduled[1].seq is long and out.scheduled[1].num_tokens == 15
    assert out.num_batched_tokens == 16
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("short", 1), ("long", 15)]
    assert long.num_computed_tokens == 30 and long.num_output_tokens == 0


def test_preemption_when_blocks_run_out_frees_the_newest_request():
    kv, sched = make(num_blocks=6, block_size=4, budget=64)
    a = add(sched, "a", 8)
    b = add(sched, "b", 8)
    run_step(sched)  # 4 blocks used
    for _ in range(8):
        out = run_step(sched)
        if out.preempted:
            break
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and kv.get_block_ids("b") == [] and b.num_computed_tokens == 0
    assert next(sched.waiting()) is b  # back at the front of the queue
    assert a.status is SequenceStatus.RUNNING


def test_abort_frees_blocks_at_any_moment():
    kv, sched = make()
    a = add(sched, "a", 10)
    b = add(sched, "b", 10)
    run_step(sched)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    c = add(sched, "c", 10)
    sched.finish(c, "abort")  # still waiting
    assert kv.num_used_blocks == 0 and kv.num_block_tables == 0 and not sched.has_unfinished()
    assert a.finish_reason == "abort" and a.is_finished


def test_step_cost_follows_the_batch_not_history():
    _, sched = make(max_seqs=4, budget=64)
    for i in range(50):
        s = add(sched, f"done{i}", 3)
        run_step(sched)
        sched.finish(s, "stop")
    add(sched, "live", 3)
    out = run_step(sched)
    assert [x.seq.request_id for x in out.scheduled] == ["live"]
    assert sched.num_unfinished == 1


def add_p(sched, rid, n, priority):
    s = Sequence(rid, [hash((rid, i)) % 1000 for i in range(n)], SamplingParams(), None, None, priority=priority)
    sched.add(s)
    return s


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    _, sched = make(max_seqs=3, budget=100)
    for rid, priority in (("bulk0", 10), ("bulk1", 10), ("chat0", 0), ("bulk2", 10), ("chat1", 0)):
        add_p(sched, rid, 5, priority)
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["chat0", "chat1", "bulk0"]


def test_a_higher_priority_request_takes_the_slot_of_the_last_running_one():
    _, sched = make(max_seqs=2, budget=100)
    old = add_p(sched, "bulk-old", 5, 10)
    new = add_p(sched, "bulk-new", 5, 10)
    run_step(sched)
    chat = add_p(sched, "chat", 5, 0)
    out = run_step(sched)
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert out.preempted == [new]
    assert {s.seq.request_id for s in out.scheduled} == {"bulk-old", "chat"}
    assert old.status is SequenceStatus.RUNNING and chat.status is SequenceStatus.RUNNING
    # Equal priorities never preempt each other: a later bulk request waits.
    add_p(sched, "bulk-later", 5, 10)
    run_step(sched)
    assert sched.num_running == 2 and new.num_preemptions == 1


def test_a_higher_priority_request_takes_kv_blocks_from_a_lower_one():
    kv, sched = make(num_blocks=6, block_size=4, max_seqs=8, budget=100)
    bulk = [add_p(sched, f"bulk{i}", 8, 10) for i in range(3)]  # 2 blocks each: the pool is full
    run_step(sched)
    assert kv.num_free_blocks == 0
    chat = add_p(sched, "chat", 6, 0)
    out = run_step(sched)
    assert chat.status is SequenceStatus.RUNNING
    assert bulk[2].status is SequenceStatus.WAITING and out.preempted[0] is bulk[2]


def test_a_higher_priority_request_short_of_blocks_preempts_a_lower_one_scheduled_before_it():
    kv, sched = make(num_blocks=4, block_size=4, budget=64)
    low = add_p(sched, "low", 1, 5)
    run_step(sched)
    high = add_p(sched, "high", 4, 0)
    for _ in range(8):  # both decode until the pool runs dry
        out = run_step(sched)
        if out.preempted:
            break
    # low was scheduled first this step (admitted first), yet it is the one that gives its blocks and budget back.
    assert out.preempted == [low] and low.status is SequenceStatus.WAITING and kv.get_block_ids("low") == []
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("high", 1)]
    assert out.num_batched_tokens == 1 and out.num_decodes == 1
    out = run_step(sched)
    assert out.preempted == [] and high.num_preemptions == 0 and high.status is SequenceStatus.RUNNING


def test_a_preempted_requests_wait_for_a_place_again_is_not_its_running_time():
    """A job's timeout counted from its first step through every wait it had preempted: a bulk job behind
    interactive work timed out (3 s) having run a fraction of that."""
    import time
    from types import SimpleNamespace

    from roseinfer.llm_engine import LLMEngine

    _, sched = make(num_blocks=4, block_size=4, budget=64)
    low = add_p(sched, "low", 1, 5)
    run_step(sched)
    began = low.first_scheduled_time
    high = add_p(sched, "high", 4, 0)
    while low.status is not SequenceStatus.WAITING:
        run_step(sched)
    engine = SimpleNamespace(_groups={}, scheduler=sched)
    time.sleep(0.05)
    assert LLMEngine.running_since(engine, "low") >= began + 0.05  # (moves on while it waits)
    sched.finish(high, "length")  # high ends: low is admitted again
    run_step(sched)
    assert low.status is SequenceStatus.RUNNING
    assert low.preempted_at is None and low.preempted_s >= 0.05
    assert low.first_scheduled_time == began  # (its first step's time stays)
    assert LLMEngine.running_since(engine, "low") == began + low.preempted_s


def test_an_unscheduled_request_leaves_no_unwritten_block_in_the_prefix_cache():
    kv, sched = make(num_blocks=5, block_size=4, budget=11)
    high = add_p(sched, "high", 2, 0)
    low = add_p(sched, "low", 2, 5)
    run_step(sched)
    long = add_p(sched, "long", 20, 0)
    run_step(sched)  # high and low decode, long takes its first 9 tokens: the pool is full
    assert kv.num_free_blocks == 0 and low.num_computed_tokens == 3
    out = run_step(sched)
    # low's decode (its token 3, completing its block) was undone for long's chunk, which then could not run anyway:
    # long is the latest arrival among the rest, so it goes too.
    assert out.preempted == [low, long]
    assert [x.seq for x in out.scheduled] == [high]
    # low's block was registered at allocation but its last slot never written: a request sharing it must not hit it.
    probe = Sequence("probe", low.token_ids + [1, 2, 3, 4], SamplingParams(), None, None)
    assert kv.lookup_computed_blocks(probe).num_tokens == 0


def test_make_room_counts_the_prefix_hit_of_the_waiting_request():
    kv = KVCacheManager(8, 4)
    sched = Scheduler(kv, 8, 64)
    system = list(range(100, 116))  # 4 full blocks
    low = Sequence("low", system + [1, 2], SamplingParams(), None, None, priority=5)
    sched.add(low)
    run_step(sched)  # 5 blocks: 3 free
    high = Sequence("high", system + [3, 4, 5], SamplingParams(), None, None, priority=0)
    sched.add(high)
    queries, hits = kv.prefix_query_tokens, kv.prefix_hit_tokens
    out = run_step(sched)
    # high shares low's 4 system blocks and needs 1 new one: nothing is preempted.
    assert out.preempted == [] and low.num_preemptions == 0
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in out.scheduled] == [("low", 18, 1), ("high", 16, 3)]
    # The look-ahead is not counted in the hit-rate stats: only the admission is.
    assert (kv.prefix_query_tokens - queries, kv.prefix_hit_tokens - hits) == (19, 16)


def test_make_room_counts_only_the_first_chunk_of_the_waiting_request():
    _, sched = make(num_blocks=6, block_size=4, budget=8)
    low = add_p(sched, "low", 4, 5)
    run_step(sched)
    add_p(sched, "high", 40, 0)
    out = run_step(sched)
    # high is admitted with a 7-token chunk (2 blocks), low's decode takes 1: both fit in the 5 free blocks.
    assert out.preempted == [] and low.status is SequenceStatus.RUNNING
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("low", 1), ("high", 7)]


def test_cached_tokens_are_those_of_the_first_admission():
    _, sched = make(num_blocks=6, block_size=4, budget=64)
    a = add(sched, "a", 8)
    b = add(sched, "b", 8)
    run_step(sched)
    for _ in range(8):
        if run_step(sched).preempted:
            break
    assert b.num_preemptions == 1 and b.num_cached_tokens == 0
    sched.finish(a, "stop")
    kv = sched.kv
    queries, hits = kv.prefix_query_tokens, kv.prefix_hit_tokens
    out = run_step(sched)
    (item,) = out.scheduled
    assert item.seq is b and item.start > 0  # the recompute found its own freed blocks in the prefix cache
    assert b.num_cached_tokens == 0  # which is not a cache hit of the request
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens) == (queries, hits)  # nor of the hit-rate stats


def test_a_request_preempted_after_filling_a_block_is_readmitted_with_a_token_to_compute():
    """B's decode filled a block (its hash kept on the request) and B was preempted in that same step before the
    sampled token was appended; A holds the same tokens in the cache. B's lookup then took every hash it had, its
    whole length: it was scheduled for 0 tokens, and the step had a sample row with no logits of its own."""
    kv = KVCacheManager(num_blocks=5, block_size=2)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=4)
    a = Sequence("A", [1, 2], SamplingParams(), None, None, priority=0)
    b = Sequence("B", [1, 2], SamplingParams(), None, None, priority=1)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    c = Sequence("C", [5, 6, 7, 8], SamplingParams(), None, None, priority=0)
    sched.add(c)
    run_step(sched)
    out = run_step(sched)
    assert b in out.preempted  # (after its decode was scheduled: C's chunk needed the blocks)
    sched.finish(c, "length")
    assert kv.lookup_computed_blocks(b).num_tokens < b.num_tokens
    out = run_step(sched)
    assert all(item.num_tokens > 0 for item in out.scheduled)


def test_a_request_waiting_for_blocks_is_counted_in_the_hit_rate_once():
    kv, sched = make(num_blocks=4, block_size=4, budget=64)
    add(sched, "big", 12)
    run_step(sched)
    add(sched, "waits", 8)  # 2 blocks, 1 free: it waits while "big" runs
    for _ in range(3):
        run_step(sched)
    assert kv.prefix_query_tokens == 12  # "big" alone: "waits" was refused, and is not counted at each step


def test_a_step_that_never_ran_leaves_no_prefix_hit_and_restarts_who_hit_its_blocks():
    """Blocks are put in the prefix cache when allocated, before the forward fills them. A step that fails (or is
    interrupted between the schedule and the forward) must leave no hash on them, and a request admitted in it on a
    hit of those blocks (the same prompt twice, a later sample) must not keep them as computed."""
    kv, sched = make(block_size=4, budget=64)
    a = Sequence("a", list(range(9)), SamplingParams(), None, None)
    b = Sequence("b", list(range(9)), SamplingParams(), None, None)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert b.num_computed_tokens == 8  # its hit: a's two full blocks, registered this step, unwritten
    sched.forget_step()
    probe = Sequence("probe", list(range(9)), SamplingParams(), None, None)
    assert kv.lookup_computed_blocks(probe).num_tokens == 0
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 0
    assert sched.num_preemptions == 0 and b.num_preemptions == 0  # an undone admission, no preemption
    out = run_step(sched)  # the step runs now: both whole, b on a's blocks written in that same step
    assert {x.seq.request_id: x.start for x in out.scheduled} == {"a": 0, "b": 8}
    assert kv.lookup_computed_blocks(probe).num_tokens == 8
    # b's undone admission is out of the hit-rate stats (it was counted again, readmitted), and its queueing time
    # goes on from before (a job's timeout began at an admission that never ran).
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens) == (18, 8)
    assert b.first_scheduled_time > a.first_scheduled_time  # (b's: of its admission that ran)


def test_the_cached_tokens_of_a_resumed_request_are_its_prompts_at_most():
    """A resumed request's prefix hit covers its earlier output too: num_cached_tokens said 20 of a 6-token prompt."""
    _, sched = make(block_size=4, budget=64)
    first = add(sched, "first", 20)
    run_step(sched)
    resumed = Sequence("resumed", first.token_ids[:6], SamplingParams(), None, None)
    resumed.token_ids += first.token_ids[6:]  # (its earlier attempt's output, resumed)
    sched.add(resumed)
    run_step(sched)
    assert resumed.num_prompt_tokens == 6 and resumed.num_cached_tokens == 6


def test_no_request_is_preempted_for_a_waiting_one_that_could_not_be_admitted_anyway():
    """Room was made one preemption at a time while the waiting head did not fit: where even every request after it
    by priority could not make room (blocks held by one before it, the budget spent by those before it), their
    K/V were thrown away and their slots left idle for nothing."""
    _, sched = make(num_blocks=8, block_size=4, budget=64)
    add_p(sched, "first", 20, 0)  # 5 blocks, priority over the head
    low = add_p(sched, "low", 3, 5)
    run_step(sched)
    head = add_p(sched, "head", 20, 1)  # 5 blocks: never more than 3 free while "first" runs
    for _ in range(3):
        out = run_step(sched)
        assert out.preempted == [] and {x.seq.request_id for x in out.scheduled} == {"first", "low"}
    assert low.num_preemptions == 0 and head.status is SequenceStatus.WAITING
    # The budget: the requests before the head spend all of it, so preempting "low" would not let the head in.
    _, sched = make(num_blocks=64, block_size=4, max_seqs=2, budget=8)
    long_first = add_p(sched, "long", 40, 0)  # a prefill of 8 tokens a step, for 5 steps
    low = add_p(sched, "low", 3, 5)
    run_step(sched)
    add_p(sched, "head", 3, 1)
    out = run_step(sched)
    assert out.preempted == [] and low.num_preemptions == 0 and long_first.status is SequenceStatus.RUNNING
    # Where preempting does let the head in, it still happens: the slot of the last one by priority.
    _, sched = make(num_blocks=64, block_size=4, max_seqs=2, budget=64)
    add_p(sched, "a", 3, 0)
    low = add_p(sched, "low", 3, 5)
    run_step(sched)
    add_p(sched, "head", 3, 1)
    assert run_step(sched).preempted == [low]


def test_room_made_for_a_waiting_request_includes_the_budget_it_needs():
    """The head lacked a slot; preempting the last request by priority gave it one, but a lower-priority prefill
    still took the whole budget, so the head was not admitted: the victim's K/V thrown away, its slot idle for
    steps. Room is made until the head gets a chunk, here by preempting that prefill too."""
    _, sched = make(num_blocks=64, block_size=4, max_seqs=3, budget=8)
    add_p(sched, "B", 3, -1)  # decoding, before the head by priority
    c = add_p(sched, "C", 3, 1)  # decoding, last by priority
    run_step(sched)
    a = add_p(sched, "A", 40, 0)  # a prefill of what the decodes leave of the budget, for steps
    run_step(sched)
    head = add_p(sched, "H", 5, -1)
    out = run_step(sched)
    assert out.preempted == [c, a] and head.status is SequenceStatus.RUNNING
    scheduled = {x.seq.request_id: (x.start, x.num_tokens) for x in out.scheduled}
    # "A" takes what budget is left again, after its prefix hit: the block it had filled stayed in the cache.
    assert scheduled == {"B": (4, 1), "H": (0, 5), "A": (4, 2)} and c.status is SequenceStatus.WAITING


def test_room_made_for_a_waiting_requests_budget_is_taken_from_a_prefill_not_from_decodes():
    """Slots free, the budget spent by a lower-priority prefill: preempting the decodes last by priority freed
    tokens that the prefill then took, each decode's K/V thrown away for nothing, until the prefill went too."""
    _, sched = make(num_blocks=64, block_size=4, max_seqs=8, budget=8)
    c, d = add_p(sched, "C", 3, 1), add_p(sched, "D", 3, 1)  # decoding, last by priority
    run_step(sched)
    a = add_p(sched, "A", 40, 0)  # a prefill of what the decodes leave of the budget, for steps
    run_step(sched)
    head = add_p(sched, "H", 5, -1)
    out = run_step(sched)
    assert out.preempted == [a] and head.status is SequenceStatus.RUNNING
    assert {x.seq.request_id: x.num_tokens for x in out.scheduled} == {"C": 1, "D": 1, "H": 5, "A": 1}
    assert c.num_preemptions == d.num_preemptions == 0


def test_a_groups_running_time_is_its_unfinished_samples():
    """A sample that had ended still counted: its start won, and an n = 2 job whose other sample waited preempted
    timed out for that wait."""
    from types import SimpleNamespace

    from roseinfer.llm_engine import LLMEngine

    ended = SimpleNamespace(first_scheduled_time=0.0, preempted_s=0.0, preempted_at=None, is_finished=True)
    waiting = SimpleNamespace(first_scheduled_time=0.0, preempted_s=9.0, preempted_at=None, is_finished=False)
    engine = SimpleNamespace(_groups={"g": [ended, waiting]}, scheduler=None)
    assert LLMEngine.running_since(engine, "g") == 9.0
    waiting.is_finished = True  # (every sample ended: the earliest, as before)
    assert LLMEngine.running_since(engine, "g") == 0.0
