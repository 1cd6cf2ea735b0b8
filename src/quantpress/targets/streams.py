"""Stream planning shared by the targets: the one streamed pass over the reference hidden
states that feeds every consumer of a source (:func:`reference_pass`), and the checkpointed
share of a consumer that writes per layer (:class:`WriterShare`)."""
from __future__ import annotations

import copy
import json
from dataclasses import fields
from typing import Any, Callable

from quantpress.calibration import engine
from quantpress.memory import trim_heap
from quantpress.targets.source import Source


class _Trim:
    """The last consumer of a shared pass: gives the allocator the layer's temporaries back."""

    stateless = True
    after_all = True       # alone, once the other consumers of the layer are done
    inputs_unused = True

    def on_layer(self, *args) -> None:
        trim_heap()


def reference_pass(source: Source, consumers: list, progress: bool = True, checkpoint=None) -> None:
    """One streamed pass of the source's calibration rows through the unquantized model,
    feeding every consumer (:class:`quantpress.calibration.engine.FanOut`), in batches of
    :meth:`Source.batch_rows` rows; resumable with ``checkpoint`` (a
    :class:`quantpress.calibration.checkpoint.LayerCheckpoint`; the consumers then implement
    ``layer_state`` / ``restore``). Raises InputError on NaN/Inf hidden states."""
    rows, _ = source.calibration_rows()
    fan = engine.FanOut([*consumers, _Trim()])
    engine.run(source.streaming_model(), rows, hooks_factory=fan.hooks, on_layer=fan.on_layer,
               batch_size=source.batch_rows(rows.shape[1]), progress=progress,
               checkpoint=checkpoint, state=fan, keep_inputs=fan.keep_inputs)


def options_json(o: Any) -> dict:
    """An options dataclass's fields as JSON values (checkpoint keys, batch manifests)."""
    return json.loads(json.dumps({f.name: getattr(o, f.name) for f in fields(o)}))


class WriterShare:
    """A checkpointed pass's share of a consumer that writes each layer's tensors with a
    :class:`quantpress.convert.shards.ModelDirWriter` and keeps one record per linear
    (``records``, names starting with ``prefix`` + the layer index): per layer, that layer's
    records, the writer's parts so far and a copy of ``timed.timings``
    (:meth:`layer_state`); a resumed pass gives them back in order (:meth:`restore`) and the
    writer adopts its parts (:meth:`resumed`). ``hooks`` / ``on_layer``, when given, make it
    the consumer itself (:class:`quantpress.calibration.engine.FanOut`)."""

    def __init__(self, writer, records: list, prefix: str, timed: Any,
                 hooks: Callable | None = None, on_layer: Callable | None = None):
        self.writer, self.records, self.prefix, self.timed = writer, records, prefix, timed
        if hooks is not None:
            self.hooks = hooks
        if on_layer is not None:
            self.on_layer = on_layer
        self._parts: list = []

    def layer_state(self, index: int) -> dict:
        p = f"{self.prefix}{index}."
        return {"records": [r for r in self.records if r.name.startswith(p)],
                "parts": self.writer.state(), "timings": copy.copy(self.timed.timings)}

    def restore(self, index: int, saved: dict) -> None:
        self.records.extend(saved["records"])
        self._parts = saved["parts"]
        self.timed.timings = copy.copy(saved["timings"])

    def resumed(self, start: int) -> None:
        self.writer.adopt(self._parts)
