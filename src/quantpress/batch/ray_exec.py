"""``quantize batch --ray [ADDRESS]``: the stages of every model of a batch as Ray tasks.

Each model's stages (:func:`quantpress.batch.stages.model_stages`: the GGUF policies, the
calibrated pass, each GPTQ target, the imatrix-weighted GGUF policies, each EXL2 target,
and the evaluation of each stage's outputs, ``eval_each``) become Ray tasks as soon as the
stages they wait for are finished, so the GGUF policies run beside the calibrated pass (and
are scored while it runs), every EXL2 target beside the others once the measurement exists,
and the models of the batch beside each other. A task reserves one GPU
when the cluster has GPUs (Ray sets ``CUDA_VISIBLE_DEVICES``, so ``device = "auto"`` picks the
task's own GPU) and one CPU otherwise (Ray then gives it one intra-op thread).

A stage task is a Ray generator (:func:`_stage_task`): it streams each output's
:class:`~quantpress.targets.base.Outcome` as the output is verified (left among the model's
verified outputs, :func:`quantpress.batch.stage_work.run_stage`), and the driver records it at
once (:class:`quantpress.batch.model_run.ModelRun`): the driver alone writes the manifests and
the model cards, after every output, and renames the output into place once its entry is
written, as a local run does, so a batch killed anywhere resumes the same way. The tasks
write the outputs and their resumable work (``.work/``) into ``OUT_ROOT/<name>/``, which must
be a path every node (and the driver) sees (a shared filesystem). ``ADDRESS`` is a running cluster (``ray start --head`` prints it; "auto" finds the
local one); without it a local Ray instance is started, which also serves several GPUs of one
box. Scheduling, placement and the transport of results are Ray's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from quantpress.batch.jobfile import OutputJob
from quantpress.batch.model_run import ModelRun
from quantpress.batch.rows import Row
from quantpress.batch.stage_work import open_source, run_eval, run_stage
from quantpress.batch.stages import ModelPlan
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


def _stage_task(plan: ModelPlan, inputs: list[tuple[OutputJob, Any]]) -> Iterator[tuple]:
    """One stage in a Ray worker: yields ``(Outcome, device, dtype)`` per output as
    :func:`run_stage` finishes it (run in a thread, the outcomes passed through a queue)."""
    import queue
    import threading

    from quantpress.targets.base import Outcome

    try:
        source = open_source(plan)
        where = (str(source.device), str(source.dtype).replace("torch.", ""))
    except Exception as e:  # the model cannot be opened here: the stage's outputs fail
        for o, opt in inputs:
            yield Outcome(opt, plan.dir / o.path, error=e), None, None
        return
    done: queue.Queue = queue.Queue()

    def work() -> None:
        try:
            run_stage(plan, inputs, source, done.put)
        except BaseException as e:  # noqa: BLE001 - handed to the generator, raised there
            done.put(e)
        finally:
            done.put(None)

    thread = threading.Thread(target=work, name="quantpress-stage", daemon=True)
    thread.start()
    while (item := done.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield (item, *where)
    thread.join()


def _eval_task(plan: ModelPlan, paths: list[str]):
    return run_eval(plan, paths)


def run_batch_ray(plans: list[ModelPlan], address: str | None = None,
                  on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Run every planned model's stages as Ray tasks (see the module docstring) and return
    the rows of all outputs, model by model in the order of ``plans``; ``on_row`` sees each row
    as its output is recorded. ``address``: an existing cluster (None: a local instance, shut
    down afterwards). Raises InputError when Ray is missing or the cluster cannot be reached."""
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
        resources = dict(num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1, max_retries=0)
        stage_task = ray.remote(**resources)(_stage_task)
        eval_task = ray.remote(**resources)(_eval_task)
        runs = [ModelRun(p, on_row, eval_each=True) for p in plans]
        pending: dict[Any, tuple[ModelRun, Any, list[str]]] = {}

        def submit(run: ModelRun) -> None:
            while (started := run.next_stage()) is not None:
                stage, inputs, paths = started
                task = eval_task.remote(run.plan, paths) if stage.is_eval else stage_task.remote(run.plan, inputs)
                pending[task] = (run, stage, paths)

        for run in runs:
            submit(run)
        while pending:
            (ready, *_), _ = ray.wait(list(pending), num_returns=1)
            run, stage, paths = pending[ready]
            error = None
            try:
                if not stage.is_eval:  # the next output of a stage task
                    run.record(*ray.get(next(ready)))
                    continue
                run.record_eval(paths, ray.get(ready))
            except StopIteration:  # the stage task is done
                pass
            except Exception as e:  # noqa: BLE001 - the task died: its unreported outputs fail
                error = getattr(e, "cause", None) or e
            del pending[ready]
            run.finish(stage, error)
            submit(run)
        return [r for run in runs for r in run.close()]
    finally:
        if started:
            ray.shutdown()
