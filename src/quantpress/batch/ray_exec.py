"""``quantize batch --ray [ADDRESS]``: the models of a batch as Ray tasks.

Each planned model (:class:`quantpress.batch.runner.ModelPlan`) becomes one Ray task running
:func:`quantpress.batch.runner.run_model` on whichever node Ray schedules it, with one GPU
reserved per task when the cluster has GPUs (Ray sets ``CUDA_VISIBLE_DEVICES``, so ``device =
"auto"`` picks the task's own GPU) and one CPU otherwise. The tasks write straight into
``OUT_ROOT/<name>/``, which must be a path every node sees (a shared filesystem); each model's
manifest is written by its own task only. ``ADDRESS`` is a running cluster (``ray start
--head`` prints it; "auto" finds the local one); without it a local Ray instance is started,
which also serves several GPUs of one box. Scheduling, retries and placement are Ray's.
"""
from __future__ import annotations

from typing import Callable

from quantpress.batch.runner import ModelPlan, Row, run_model
from quantpress.errors import InputError


def _ray():
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs Ray, which is not installed: pip install 'quantpress[ray]' "
                         "(or pip install ray)") from None
    return ray


def check_ray() -> None:
    """InputError (with how to install it) when Ray is not importable."""
    _ray()


def _run_model_task(plan: ModelPlan) -> list[Row]:
    return run_model(plan, progress=False)


def run_batch_ray(plans: list[ModelPlan], address: str | None = None,
                  on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Run every planned model as a Ray task (see the module docstring) and return the rows of
    all outputs, model by model in the order of ``plans``; ``on_row`` sees each model's rows
    as its task finishes. ``address``: an existing cluster (None: a local instance, shut down
    afterwards). Raises InputError when Ray is missing or the cluster cannot be reached."""
    ray = _ray()
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise InputError(f"--ray {address or ''}: cannot start or reach a Ray cluster "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        task = ray.remote(num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1,
                          max_retries=0)(_run_model_task)
        pending = {task.remote(p): i for i, p in enumerate(plans)}
        done: dict[int, list[Row]] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                i = pending.pop(ref)
                done[i] = ray.get(ref)
                if on_row is not None:
                    for r in done[i]:
                        on_row(r)
        return [r for i in range(len(plans)) for r in done[i]]
    finally:
        if started:
            ray.shutdown()
