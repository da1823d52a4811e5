"""A rollout that stays open between training steps (streaming GRPO).

Requests join it at any time (`submit`), each submission with its own seed, so that a request draws the same
tokens as in a rollout of its submission alone on the same weights. `run` decodes until the caller has what it
waits for (say, a training batch of finished groups), then stops between two decode steps, with no step
launched ahead: the caller may then change the parameters in place (an optimizer step), and the next decode step
of every running sequence reads the new ones (the in-flight weight update of PipelineRL and NeMo-RL). Each sampled
token records the policy version it was drawn under (`version`, which the caller sets after each update).

Between runs the pool (and the CUDA graphs) are given back as after a rollout (`release`, with the engine's
release_memory): the sequences in flight are preempted, and recomputed from their tokens when the stream runs
again, so that training has the memory it has in a synchronous run. With release_memory=False the pool is kept,
with the keys and values computed so far. A generate() on the same engine is refused until the stream is closed.
A hybrid's recurrent states take a slot for each sequence in flight (`max_sequences` of them), recycled as
sequences end.

`decode_beside` runs a number of decode steps in a worker thread while the caller computes beside them (streaming
GRPO's scoring and training, before the optimizer step), on a CUDA stream of their own."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from rlcu.contracts import SamplingParams
from rlcu.engine.pool import pool_size
from rlcu.engine.sequence import Sequence
from rlcu.engine.threads import beside_decoding


class EngineStream:
    def __init__(self, engine, sampling: SamplingParams, max_sequences: int, max_prompt_tokens: int):
        """`sampling`: every request's settings but the seed (each submission's own); `max_sequences` and
        `max_prompt_tokens`: what the pool is sized for (the scheduler preempts and recomputes beyond it)."""
        if engine.stream is not None:
            raise RuntimeError("a stream is already open on this engine")
        self.engine, self.sampling = engine, sampling
        shape = Sequence([0], max_prompt_tokens, sampling.max_tokens, frozenset(), 0)
        # a hybrid's recurrent states: a slot for each sequence in flight, recycled as sequences end
        self.state_slots = max_sequences if engine.model.config.linear_layers else 0
        state_bytes = self.state_slots * engine._bytes_per_slot()
        self.num_blocks = pool_size([shape] * max_sequences, engine.config, engine.model, engine._pool_bytes_held(),
                                    state_bytes)
        # the pool itself is taken when decoding starts
        engine._start([], sampling, num_blocks=self.num_blocks, state_slots=self.state_slots)
        engine.stream = self
        self.next_request = 0
        self.decode_steps = self.decoded_rows = 0  # since the last take_stats()
        self.cuda_stream = None  # the CUDA stream of the decode steps beside other work (`decode_beside`)

    @property
    def version(self) -> int:
        return self.engine.scheduler.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.scheduler.version = value

    def submit(self, prompt_token_ids: list[list[int]], seed: int | None) -> int:
        """Queue the prompts (adjacent identical ones share their prefill); returns the first one's request
        index, the others following it."""
        first = self.next_request
        for seq in self.engine._requests(prompt_token_ids, self.sampling, first, seed):
            self.engine.scheduler.add(seq)
        self.next_request += len(prompt_token_ids)
        return first

    def run(self, until: Callable[[], bool], should_stop: Callable[[], bool] | None = None) -> None:
        """Decode until `until()` (asked between decode steps) or until no request is left; `should_stop` as in
        LLMEngine.generate. On return no decode step is in flight."""
        engine = self.engine
        engine._should_stop = should_stop
        with torch.inference_mode(False), torch.no_grad():
            engine._prepare_runner(self.num_blocks, self.state_slots)  # after a release: a new pool, the same size
            while not engine.scheduler.is_finished() and not until():
                self._step()
            engine._pausing = True  # the step launched ahead (on this version's weights) is taken, none is launched
            try:
                while engine._ahead is not None:
                    self._step()
            finally:
                engine._pausing = False

    def _step(self) -> None:
        running = len(self.engine.scheduler.running)
        self.engine.step()
        self.engine._check_stop()
        self.decode_steps += 1
        self.decoded_rows += running

    def decode_beside(self, steps: int) -> DecodeBeside:
        """`steps` decode steps (fewer if the requests run out; -1: until `wait()` is called) in a worker thread, on
        the parameters as they are: the caller must not change them before `DecodeBeside.wait()` returns."""
        return DecodeBeside(self, steps)

    def release(self, force: bool = False) -> None:
        """Give the pool back while the caller trains (the engine's release_memory, or `force`): every sequence in
        flight is preempted, so that its keys and values are recomputed from its tokens, on the weights of then,
        when the stream runs again."""
        engine = self.engine
        if not (engine.config.release_memory or force) or engine.scheduler is None:
            return
        scheduler = engine.scheduler
        for seq in reversed(list(scheduler.running)):  # each goes to the queue's front: the order is kept
            scheduler.preempt(seq)
        for seq in scheduler.waiting:
            if seq.block_table:
                scheduler.bm.free_sequence(seq)
        if scheduler.bm.num_free != scheduler.bm.num_blocks:
            raise AssertionError(f"{scheduler.bm.num_blocks - scheduler.bm.num_free} KV blocks held after release")
        engine.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def finished(self) -> dict[int, Sequence]:
        """Finished requests by index, until `pop`ped."""
        return self.engine.scheduler.finished

    def pop(self, request: int) -> Sequence:
        return self.engine.scheduler.finished.pop(request)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        s = self.engine.scheduler
        return len(s.running) + sum(1 + q.pending_forks for q in s.waiting)

    def take_stats(self) -> tuple[int, float]:
        """(decode steps, mean sequences per decode step) since the last call."""
        steps, rows = self.decode_steps, self.decoded_rows
        self.decode_steps = self.decoded_rows = 0
        return steps, rows / steps if steps else 0.0

    def close(self) -> None:
        """Drop every request in flight (their blocks go back), end the stream; the pool is released as after a
        rollout."""
        engine = self.engine
        if engine.stream is not self:
            return
        if engine.scheduler is not None:
            for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
                engine.scheduler.bm.free_sequence(seq)
        engine.scheduler, engine._ahead, engine.stream = None, None, None
        engine.release()


class DecodeBeside:
    """A stream's decode steps in a worker thread, beside the caller's own work. On CUDA the steps go to a CUDA
    stream of their own, ordered after the work queued when they start, so that the GPU runs them between the
    caller's kernels; they run in the autocast of the thread that started them, as they would have there. Their
    CUDA graphs are replayed, never captured (`DecodeGraphs.capture`): a batch without its graph yet decodes
    eagerly. The interpreter's switch interval is shortened meanwhile (`beside_decoding`), so that the decode loop
    gets the lock back soon after each wait on the GPU."""

    def __init__(self, stream: EngineStream, steps: int):
        self.stream, self.steps, self.asked, self.error = stream, steps, 0, None
        self.done = threading.Event()  # steps -1: set by wait(), the decode loop stops at its next step
        with torch.inference_mode(False), torch.no_grad():  # the pool (if released) taken here, not in the worker
            stream.engine._prepare_runner(stream.num_blocks, stream.state_slots)
        device = stream.engine.model.device
        self.kind = device.type
        self.autocast = torch.get_autocast_dtype(self.kind) if torch.is_autocast_enabled(self.kind) else None
        self.cuda = None
        if self.kind == "cuda":
            if stream.cuda_stream is None:  # one for the stream's life: the allocator caches memory per CUDA stream
                stream.cuda_stream = torch.cuda.Stream(device, priority=stream.engine.config.beside_priority)
            self.cuda = stream.cuda_stream
            self.cuda.wait_stream(torch.cuda.current_stream(device))
        self.start_steps = stream.decode_steps
        self.switch = contextlib.ExitStack()  # the shortened switch interval, until wait()
        self.switch.enter_context(beside_decoding())
        self.thread = threading.Thread(target=self._work, name="rlcu-decode-beside", daemon=True)
        self.thread.start()

    def _until(self) -> bool:
        self.asked += 1
        return self.done.is_set() if self.steps < 0 else self.asked > self.steps

    def _work(self) -> None:
        runner = self.stream.engine.runner
        graphs = getattr(runner, "graphs", None)
        try:
            with contextlib.ExitStack() as stack:
                if self.cuda is not None:
                    stack.enter_context(torch.cuda.stream(self.cuda))
                stack.enter_context(torch.autocast(self.kind, dtype=self.autocast or torch.bfloat16,
                                                   enabled=self.autocast is not None))
                stack.enter_context(torch.profiler.record_function("rlcu/decode_beside"))  # in profiles
                if graphs is not None:
                    graphs.capture = False
                    stack.callback(setattr, graphs, "capture", True)
                self.stream.run(self._until)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by wait()
            self.error = e

    def wait(self) -> int:
        """Until the steps are done (their GPU work ordered before the caller's next); returns how many ran."""
        self.done.set()
        self.thread.join()
        self.switch.close()
        if self.cuda is not None:
            torch.cuda.current_stream(self.cuda.device).wait_stream(self.cuda)
        if self.error is not None:
            raise self.error
        return self.stream.decode_steps - self.start_steps
