"""The model names, at each norm and SwiGLU, the weights its next linear layers read (ops' prefetch=, which the GPU
turns into an L2 prefetch): checked against the order the forward pass actually reads them."""

import numpy as np

from infero.engine.batch import SequenceStep, build_batch


class RecordingOps:
    """CpuOps, recording each prefetch request and each weight a linear reads, in call order."""

    def __init__(self, ops):
        self.ops, self.events = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def add_rms_norm(self, *args, prefetch=()):
        self.events.append(("prefetch", tuple(prefetch)))
        return self.ops.add_rms_norm(*args)

    def swiglu(self, gate, up, prefetch=()):
        self.events.append(("prefetch", tuple(prefetch)))
        return self.ops.swiglu(gate, up)

    def linear(self, x, weight, bias=None):
        self.events.append(("read", (weight,)))
        return self.ops.linear(x, weight, bias)

    def linears(self, x, weights, biases=None):
        self.events.append(("read", tuple(weights)))
        return self.ops.linears(x, weights, biases)

    def qkv_rotary_store(self, x, weights, *args):
        self.events.append(("read", tuple(weights)))
        return self.ops.qkv_rotary_store(x, weights, *args)


def test_each_prefetch_names_the_weights_read_next(tiny_model):
    model, backend = tiny_model
    recording = RecordingOps(model.ops)
    model.ops = recording
    try:
        cache = backend.allocate_kv_cache(model.config, 4, 16)
        model.forward(build_batch([SequenceStep([1, 2, 3], 0, [0])], 16), cache)
    finally:
        model.ops = recording.ops
    prefetches = [i for i, (kind, _) in enumerate(recording.events) if kind == "prefetch"]
    assert len(prefetches) == 3 * model.config.num_layers + 1
    for i in prefetches:
        wanted = recording.events[i][1]
        read = [w for kind, ws in recording.events[i + 1 :] if kind == "read" for w in ws][: len(wanted)]
        assert wanted and len(read) == len(wanted)
        assert all(a is b for a, b in zip(wanted, read, strict=True)), f"event {i}: prefetch is not what is read next"
    assert np.all([len(ws) > 0 for _, ws in recording.events])
