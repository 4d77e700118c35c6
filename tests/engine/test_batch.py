"""The forward interface: paged KV cache, prefill chunks and decodes, batch invariance."""

import numpy as np
from helpers import relative_error

from infero.engine.batch import SequenceStep, build_batch

BS = 16
PROMPT_A = [1, 40, 75, 3, 200, 17, 99, 150, 42, 7, 260, 5, 9, 11, 13, 15, 17, 19, 21]
PROMPT_B = [1, 8, 100, 44]


def run(tiny_model, steps, num_blocks=16):
    model, backend = tiny_model
    cache = backend.allocate_kv_cache(model.config, num_blocks, BS)
    outs = []
    for step in steps:
        outs.append(backend.forward(model, build_batch(step, BS), cache))
    return outs


def test_decode_after_prefill_matches_prefill_of_all(tiny_model):
    ids = PROMPT_A
    [full] = run(tiny_model, [[SequenceStep(ids, 0, [3, 7], "all")]])
    steps = [[SequenceStep(ids[:10], 0, [3, 7], "all")]]
    steps += [[SequenceStep([ids[i]], i, [3, 7])] for i in range(10, len(ids))]
    outs = run(tiny_model, steps)
    incremental = np.concatenate(outs)
    assert relative_error(incremental, full) < 1e-4
    assert (incremental.argmax(-1) == full.argmax(-1)).all()


def test_chunked_prefill_matches_whole_prefill(tiny_model):
    ids = PROMPT_A
    [full] = run(tiny_model, [[SequenceStep(ids, 0, [0, 1], "all")]])
    chunks = [(0, 7), (7, 16), (16, len(ids))]  # the second chunk crosses a block boundary
    outs = run(tiny_model, [[SequenceStep(ids[a:b], a, [0, 1], "all")] for a, b in chunks])
    assert relative_error(np.concatenate(outs), full) < 1e-4


def test_block_placement_does_not_change_logits(tiny_model):
    [a] = run(tiny_model, [[SequenceStep(PROMPT_A, 0, [0, 1], "all")]])
    [b] = run(tiny_model, [[SequenceStep(PROMPT_A, 0, [9, 4], "all")]])
    np.testing.assert_array_equal(a, b)


def test_mixed_batch_gives_each_sequence_its_alone_logits(tiny_model):
    # Sequence A: cached prefix of 10, then a prefill chunk of 9; B: a whole prompt; C: a decode at position 6.
    a, b, c = PROMPT_A, PROMPT_B, [1, 5, 6, 7, 8, 9, 10]
    setup = [[SequenceStep(a[:10], 0, [0, 1], "none")], [SequenceStep(c[:6], 0, [5], "none")]]

    def alone(step):
        return run(tiny_model, setup + [[step]])[-1]

    steps = [SequenceStep(a[10:], 10, [0, 1], "all"), SequenceStep(b, 0, [2, 3], "last"),
             SequenceStep(c[6:], 6, [5], "last")]  # fmt: skip
    mixed = run(tiny_model, setup + [steps])[-1]
    expected = np.concatenate([alone(s) for s in steps])
    np.testing.assert_array_equal(mixed, expected)
    assert mixed.shape[0] == 9 + 1 + 1


def test_logits_rows_follow_logits_indices(tiny_model):
    [full] = run(tiny_model, [[SequenceStep(PROMPT_B, 0, [0], "all")]])
    [last] = run(tiny_model, [[SequenceStep(PROMPT_B, 0, [0], "last")]])
    np.testing.assert_array_equal(last[0], full[-1])
    [none] = run(tiny_model, [[SequenceStep(PROMPT_B, 0, [0], "none")]])
    assert none.shape[0] == 0


def test_state_slots_follow_the_sequences_and_default_to_none():
    batch = build_batch([SequenceStep([5, 6], 0, [0], state_slot=3), SequenceStep([7], 4, [1])], BS)
    assert batch.state_slots.tolist() == [3, -1] and batch.state_slots.dtype == np.int32
