"""The worker's persistent batch and the one flat-batch builder (folio/worker/input_batch.py,
flat_batch.py), driven by a real scheduler's step messages (through msgpack): over random runs
— prefix hits, chunked prefill, preemption in a tight cache, async scheduling's pending
inputs — the worker's state equals the scheduler's, and every padding mode's staged buffers
equal a from-scratch fill."""
from __future__ import annotations

import msgspec
import pytest
import torch

from folio.core.step_messages import SchedulerOutput
from folio.worker.flat_batch import Padding, StepBuffers, build_flat_batch
from folio.worker.input_batch import InputBatch

from scheduler_steps import scheduler_steps

BS = 4
MAX_LEN = 60
MAX_REQS = 6
BUDGET = 40
WIDTH = -(-MAX_LEN // BS)


def _expected(case):
    ids, pos, slots, qsl, pend = [], [], [0], [0], []
    slots = []
    for i, item in enumerate(case.step.scheduled):
        rid = item.request_id
        known = case.known_tokens[rid]
        blocks = case.block_ids[rid]
        for p in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens):
            if p < len(known):
                ids.append(known[p])
            else:
                pend.append((len(ids), case.prev_rows[rid]))
                ids.append(0)
            pos.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + item.num_new_tokens)
    return ids, pos, slots, qsl, pend


def _worker_steps(seed: int, async_scheduling: bool, batch: InputBatch):
    """The non-empty steps of a random scheduler run, each message (through msgpack, as the
    workers get it) applied to `batch`: (the step's case, its message)."""
    for case in scheduler_steps(seed, block_size=BS, max_model_len=MAX_LEN, max_reqs=MAX_REQS,
                                budget=BUDGET, num_blocks=20, async_scheduling=async_scheduling,
                                num_steps=150):
        message = msgspec.msgpack.decode(msgspec.msgpack.encode(case.step.message),
                                         type=SchedulerOutput)
        batch.update(message)
        if not case.step.is_empty:
            yield case, message


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_worker_state_and_staged_inputs_match_the_scheduler(seed, async_scheduling):
    batch = InputBatch(MAX_REQS, WIDTH, torch.device("cpu"), MAX_LEN)
    # One set of buffers per padding mode, as the eager runner and the two graph runners hold.
    eager = StepBuffers(BUDGET, MAX_REQS, WIDTH, pin=False)
    decode = StepBuffers(MAX_REQS, MAX_REQS, WIDTH, pin=False)
    mixed = StepBuffers(BUDGET + 8, MAX_REQS + 1, WIDTH, pin=False)
    seen = dict(steps=0, pending=0, decode=0, preempted=0)
    for case, message in _worker_steps(seed, async_scheduling, batch):
        seen["steps"] += 1
        seen["preempted"] += len(message.preempted_req_ids)
        for item in case.step.scheduled:
            state = batch.requests[item.request_id]
            assert batch.token_ids_of(state).tolist() == case.known_tokens[item.request_id]
            assert batch.num_prompt_tokens[state.row] == state.num_prompt_tokens
            assert state.num_computed_tokens == item.num_computed_tokens
            nb = int(batch.num_blocks[state.row])
            assert batch.block_table[state.row, :nb].tolist() == case.block_ids[item.request_id]
        rows = [batch.requests[rid].row for rid in message.num_scheduled_tokens]
        assert len(set(rows)) == len(rows), "two requests share a row"
        ids, pos, slots, qsl, pend = _expected(case)
        T, B = len(ids), len(case.step.scheduled)
        seen["pending"] += len(pend)

        flat = build_flat_batch(message, batch, case.prev_rows, eager, BS)
        assert (flat.num_tokens, flat.num_reqs, flat.padded_tokens) == (T, B, T)
        assert flat.query_start_loc == qsl
        assert list(zip(flat.pending_dst, flat.pending_src)) == pend
        assert eager.ids[:T].tolist() == ids and eager.pos[:T].tolist() == pos
        assert eager.slots[:T].tolist() == slots
        assert eager.seq[:B].tolist() == [s.num_computed_tokens + s.num_new_tokens
                                          for s in case.step.scheduled]
        for i, item in enumerate(case.step.scheduled):
            used = -(-(item.num_computed_tokens + item.num_new_tokens) // BS)
            assert eager.bt[i, :used].tolist() == case.block_ids[item.request_id][:used]

        if T == B:  # pure decode: the decode graphs' padding
            seen["decode"] += 1
            padded = min(MAX_REQS, B + seed % 3)
            build_flat_batch(message, batch, case.prev_rows, decode, BS, Padding.DECODE_ROWS,
                             padded=padded)
            assert decode.ids[:padded].tolist() == ids + [0] * (padded - B)
            assert decode.slots[:padded].tolist() == slots + [-1] * (padded - B)
            assert decode.seq[B:padded].tolist() == [1] * (padded - B)
            assert (decode.bt[B:padded, 0] == 0).all()
            # the decode graphs read query_start_loc from the copy too: row i is query i
            assert decode.qsl[:padded + 1].tolist() == list(range(padded + 1))
            # one copy moves the step to the graphs' buffers
            mirror = decode.mirror(torch.device("cpu"))
            decode.copy_to(mirror, padded)
            for name, host in decode.tensors.items():
                rows = slice(0, padded) if name == "block_tables" else slice(None)
                assert torch.equal(mirror.tensors[name][rows], host[rows]), name

        padded = T + (0, 1, 5)[seed % 3]
        flat = build_flat_batch(message, batch, case.prev_rows, mixed, BS,
                                Padding.DUMMY_REQUEST, padded=padded)
        assert flat.padded_tokens == padded
        assert mixed.ids[:padded].tolist() == ids + [0] * (padded - T)
        assert mixed.pos[:padded].tolist() == pos + [0] * (padded - T)
        assert mixed.slots[:padded].tolist() == slots + [-1] * (padded - T)
        # Request slots: the real ones, the dummy owning [T, padded), then empty ones.
        assert mixed.qsl.tolist() == qsl + [padded] * (MAX_REQS + 1 - B)
        assert mixed.seq[B] == padded - T and (mixed.seq[B + 1:] == 0).all()
    assert seen["steps"] > 60 and seen["decode"] > 3
    if async_scheduling:
        assert seen["pending"] > 5
    assert seen["preempted"] > 0, "the tight cache never preempted: the test lost its edge"


def test_seeded_generator_survives_preemption():
    """A preempted request gives its row back but keeps its state (its seeded generator goes
    on where it stopped); a finished one is dropped and its row reused."""
    from folio.core.step_messages import CachedRequestData, NewRequestData
    from folio.sampling_params import SamplingParams
    batch = InputBatch(2, 4, torch.device("cpu"), 16)

    def step(step_id, new=(), cached=(), finished=(), preempted=()):
        return SchedulerOutput(step_id, list(new), list(cached), {}, 0, [], list(finished),
                               list(preempted))

    batch.update(step(1, new=[NewRequestData("a", [1, 2], SamplingParams(seed=7), [2], [[5]], 0)]))
    state = batch.requests["a"]
    first = torch.rand(1, generator=state.sampling.generator)
    batch.update(step(2, preempted=["a"]))
    assert state.row == -1 and "a" in batch.requests
    batch.update(step(3, cached=[CachedRequestData("a", [[8, 9]], [11], 0, True)]))
    assert batch.requests["a"] is state and state.row >= 0
    assert batch.block_table[state.row, :batch.num_blocks[state.row]].tolist() == [8, 9]
    assert batch.token_ids_of(state).tolist() == [1, 2, 11] and state.num_prompt_tokens == 2
    second = torch.rand(1, generator=state.sampling.generator)
    fresh = torch.Generator().manual_seed(7)
    assert torch.equal(torch.cat([first, second]), torch.rand(2, generator=fresh))
    batch.update(step(4, finished=["a"]))
    assert "a" not in batch.requests and len(batch._free_rows) == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_kv_cache_groups_get_their_own_tables_and_slots(seed, async_scheduling):
    """Sliding-window layers beside a full one: each KV cache group's block-table row and the
    step's slot mapping follow that group's block ids (the worker keeps the ids it was sent
    where the scheduler has since put the null block: those lie before every window)."""
    windows = (8, None, 8)
    batch = InputBatch(MAX_REQS, WIDTH, torch.device("cpu"), MAX_LEN, num_kv_groups=3)
    eager = StepBuffers(BUDGET, MAX_REQS, WIDTH, pin=False, num_kv_groups=3)
    freed = 0
    for case in scheduler_steps(seed, block_size=BS, max_model_len=MAX_LEN, max_reqs=MAX_REQS,
                                budget=BUDGET, num_blocks=40, async_scheduling=async_scheduling,
                                num_steps=150, windows=windows):
        message = msgspec.msgpack.decode(msgspec.msgpack.encode(case.step.message),
                                         type=SchedulerOutput)
        batch.update(message)
        if case.step.is_empty:
            continue
        flat = build_flat_batch(message, batch, case.prev_rows, eager, BS)
        start = 0
        for i, item in enumerate(case.step.scheduled):
            state = batch.requests[item.request_id]
            end = item.num_computed_tokens + item.num_new_tokens
            for g, ids in enumerate(case.group_block_ids[item.request_id]):
                held = batch.block_tables[g][state.row, :batch.group_num_blocks[g][state.row]]
                assert len(held) == len(ids)
                first = 0 if g == 0 else max(0, item.num_computed_tokens - 8 + 1) // BS
                assert held[first:].tolist() == ids[first:]
                assert eager.group_bt[g][i, first:-(-end // BS)].tolist() == \
                    ids[first:-(-end // BS)]
                freed += ids[:first].count(0)
                positions = range(item.num_computed_tokens, end)
                assert eager.group_slots[g][start:start + item.num_new_tokens].tolist() == \
                    [ids[p // BS] * BS + p % BS for p in positions]
            start += item.num_new_tokens
        assert flat.widths[0] == flat.width and len(flat.widths) == 3
    assert freed > 0, "no block was freed out of a window"


def test_sampling_columns_follow_rows_through_preemption():
    """The batch's per-row sampling columns and token rows give, for any order of sampling
    rows, what the requests themselves say — also after a request was preempted, parked its
    tokens and came back in another row."""
    import numpy as np

    from folio.core.step_messages import CachedRequestData, NewRequestData
    from folio.sampling_params import SamplingParams
    from folio.worker.sampling_columns import SCALAR_COLUMNS, SamplingColumns
    batch = InputBatch(4, 4, torch.device("cpu"), 16)
    params = {"a": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
              "b": SamplingParams(temperature=0.0),
              "c": SamplingParams(temperature=1.2, min_p=0.1, frequency_penalty=0.5,
                                  presence_penalty=0.25, seed=3)}
    prompts = {"a": [1, 2, 3], "b": [4], "c": [5, 6]}

    def step(step_id, new=(), cached=(), preempted=()):
        return SchedulerOutput(step_id, list(new), list(cached), {}, 0, [], [], list(preempted))

    batch.update(step(1, new=[NewRequestData(r, prompts[r], params[r], [i], [[0]], 0)
                              for i, r in enumerate("abc")]))
    outputs = {"a": [9], "b": [8], "c": [7]}
    batch.update(step(2, cached=[CachedRequestData(r, [[]], outputs[r], len(prompts[r]), False)
                                 for r in "abc"]))
    batch.update(step(3, preempted=["a"]))
    batch.update(step(4, new=[NewRequestData("d", [11], SamplingParams(), [3], [[0]], 0)]))
    batch.update(step(5, cached=[CachedRequestData("a", [[5]], [10], 0, True)]))
    outputs["a"].append(10)
    assert batch.requests["a"].row == 3 and batch.requests["d"].row == 0
    order = ["c", "a", "b"]
    rows = np.array([batch.requests[r].row for r in order])
    got = batch.sampling_columns(rows)
    got.pending_row[1] = 1
    want = SamplingColumns.from_params([params[r] for r in order],
                                       [(prompts[r], outputs[r]) for r in order],
                                       seeded=[True, False, False],
                                       pending_row=[None, 1, None])
    for name in (*SCALAR_COLUMNS, "seeded", "needs_processors", "pending_row",
                 "num_prompt_tokens", "num_tokens"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    for outputs_only in (False, True):
        assert np.array_equal(got.history([0, 1, 2], outputs_only, -1),
                              want.history([0, 1, 2], outputs_only, -1))
    assert got.history([1], True, -1).tolist() == [[9, 10]]
    # The next step of the same rows reuses the columns but sees the new token counts; a row
    # handed to another request makes the batch gather again.
    batch.update(step(6, cached=[CachedRequestData("c", [[]], [12], 3, False)]))
    again = batch.sampling_columns(rows)
    assert again.num_tokens.tolist() == [4, 5, 2] and (again.pending_row == -1).all()
    assert again.temperature is got.temperature
    batch.update(SchedulerOutput(7, [], [], {}, 0, [], ["b"], []))
    batch.update(step(8, new=[NewRequestData("e", [13], SamplingParams(temperature=0.3),
                                             [2], [[0]], 0)]))
    assert batch.requests["e"].row == rows[2]
    fresh = batch.sampling_columns(rows)
    assert fresh.temperature.tolist() == pytest.approx([1.2, 0.7, 0.3])
    assert fresh.num_tokens.tolist() == [4, 5, 1]


def test_one_arena_one_copy():
    """StepBuffers' arrays are views of one byte arena, the block tables last: copy_to moves
    every per-token and per-request array and the first rows of the block table to a mirror
    in one copy, and leaves the mirror's other block-table rows alone."""
    buf = StepBuffers(10, 4, 7, pin=False)
    arena = buf.tensors["input_ids"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == arena for t in buf.tensors.values())
    assert buf.slots.tolist() == [-1] * 10 and not buf.bt.any()
    gen = torch.Generator().manual_seed(0)
    for t in buf.tensors.values():
        t.copy_(torch.randint(0, 1000, t.shape, generator=gen))
    mirror = buf.mirror(torch.device("cpu"))
    assert (mirror.tensors["slot_mapping"] == -1).all()    # a mirror starts as filled
    buf.copy_to(mirror, 2)
    for name, host in buf.tensors.items():
        if name != "block_tables":
            assert torch.equal(mirror.tensors[name], host), name
    assert torch.equal(mirror.tensors["block_tables"][:2], buf.tensors["block_tables"][:2])
    assert not mirror.tensors["block_tables"][2:].any()
    # The copy's views are made once per row count and kept: later copies carry the values
    # written since, through the kept views and through new ones.
    for rows in (3, 2):
        for t in buf.tensors.values():
            t.copy_(torch.randint(0, 1000, t.shape, generator=gen))
        buf.copy_to(mirror, rows)
        assert torch.equal(mirror.tensors["input_ids"], buf.tensors["input_ids"])
        assert torch.equal(mirror.tensors["block_tables"][:rows],
                           buf.tensors["block_tables"][:rows])
    assert sorted(mirror.views) == [buf._layout["block_tables"][0] + r * 7 * 4 for r in (2, 3)]
    with pytest.raises(AssertionError, match="a mirror of other buffers"):
        StepBuffers(10, 4, 9, pin=False).copy_to(mirror, 1)
    with pytest.raises(AssertionError, match="one KV cache group"):
        StepBuffers(4, 2, 3, pin=False, num_kv_groups=2).copy_to(mirror, 1)


def _build_both(monkeypatch, message, batch, prev_rows, small, full, padding, padded):
    """The step built by the request-by-request path (small batches) into `small` and by the
    array path (flat_batch.SMALL_BATCH = 0) into `full`: the FlatBatch and every buffer must
    agree."""
    from folio.worker import flat_batch
    got = build_flat_batch(message, batch, prev_rows, small, BS, padding, padded=padded)
    with monkeypatch.context() as patch:
        patch.setattr(flat_batch, "SMALL_BATCH", 0)
        want = build_flat_batch(message, batch, prev_rows, full, BS, padding, padded=padded)
    assert got == want
    for name, tensor in small.tensors.items():   # (the arenas' alignment gaps are never set)
        assert torch.equal(tensor, full.tensors[name]), (name, padding)
    return got


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_small_batch_path_builds_what_the_array_path_builds(monkeypatch, seed, async_scheduling):
    """flat_batch._build_small (steps of up to SMALL_BATCH requests) against the numpy path
    on real scheduler steps (prefill chunks, decodes, pending inputs), in every padding mode,
    and on verify steps made from the decode steps by giving each request drafts."""
    import msgspec.structs
    from folio.worker import flat_batch
    batch = InputBatch(MAX_REQS, WIDTH, torch.device("cpu"), MAX_LEN)
    bufs = {padding: (StepBuffers(BUDGET + 8, MAX_REQS + 1, WIDTH, pin=False),
                      StepBuffers(BUDGET + 8, MAX_REQS + 1, WIDTH, pin=False))
            for padding in Padding}
    seen = dict(small=0, verify=0, pending=0)
    for case, message in _worker_steps(seed, async_scheduling, batch):
        B, T = len(message.num_scheduled_tokens), message.total_num_scheduled_tokens
        seen["small"] += B <= flat_batch.SMALL_BATCH
        for padding, (small, full) in bufs.items():
            padded = (None if padding is Padding.NONE
                      else min(MAX_REQS, B + seed % 2) if padding is Padding.DECODE_ROWS
                      else T + 3)
            if padding is Padding.DECODE_ROWS and T != B:
                continue
            flat = _build_both(monkeypatch, message, batch, case.prev_rows, small, full,
                               padding, padded)
            seen["pending"] += len(flat.pending_dst)
        states = [batch.requests[rid] for rid in message.num_scheduled_tokens]
        if T == B and all(s.num_computed_tokens < batch.num_tokens[s.row] for s in states):
            # the same decodes as a verify step: 1 + k tokens per request, k in 1..3
            drafts = {rid: [7 + i for i in range(1 + (j + seed) % 3)]
                      for j, rid in enumerate(message.num_scheduled_tokens)}
            counts = {rid: 1 + len(d) for rid, d in drafts.items()}
            verify = msgspec.structs.replace(message, num_scheduled_tokens=counts,
                                             total_num_scheduled_tokens=sum(counts.values()),
                                             scheduled_spec_decode_tokens=drafts)
            small, full = bufs[Padding.DUMMY_REQUEST]
            flat = _build_both(monkeypatch, verify, batch, case.prev_rows, small, full,
                               Padding.DUMMY_REQUEST, verify.total_num_scheduled_tokens + 2)
            assert small.ids[1:1 + len(drafts[states[0].req_id])].tolist() == \
                drafts[states[0].req_id]
            seen["verify"] += 1
    assert seen["small"] > 30
    if async_scheduling:   # (every decode input is pending then: no verify step is made)
        assert seen["pending"] > 3
    else:
        assert seen["verify"] > 3
