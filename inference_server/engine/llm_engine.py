"""The synchronous engine core: add requests, abort them, run steps, emit token events.

Not thread-safe on its own: ``AsyncEngine`` drives it from one thread.

Where the runner can (CUDA graphs, rows sampled on the device: ``ModelRunner.launch``), a
step is launched and its tokens are read one call later, after the next step is launched:
the host's per-step work (token bookkeeping, detokenization, events, scheduling, planning) runs while
the device computes. The launched step's sampled sequences carry a placeholder token until
then. A sequence that stops on the token being read (EOS, a stop string) has one more row in
the step launched after it; that row's token is dropped. A constrained sequence (structured
output) is the exception: its grammar must take its newest token before its next mask is filled
on the host, so a step with such a sequence whose token is still on the device is launched only
once that token is read (``_grammar_waits``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.detokenizer import IncrementalDetokenizer
from loraplex.inference_server.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarState
from loraplex.inference_server.engine.launched import LaunchedStep
from loraplex.inference_server.engine.model_runner import ModelRunner, PromptLogprobs, StepOutput
from loraplex.inference_server.engine.request import FinishReason, GenerationRequest, Timings, TokenEvent, Usage
from loraplex.inference_server.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.inference_server.engine.sequence import PLACEHOLDER, SeqStatus, Sequence
from loraplex.inference_server.lora.resident import ResidentAdapter

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        scheduler_config: SchedulerConfig,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        release_adapter: Callable[[ResidentAdapter], None],
        seed: int = 0,
        launch_ahead: bool = True,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.runner = runner
        self.grammars = grammars  # structured output (None: constrained requests are refused)
        self.tokenizer = tokenizer
        self.blocks: BlockManager = runner.blocks
        self.scheduler = Scheduler(scheduler_config, self.blocks)
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self._release_adapter = release_adapter
        self._seqs: dict[str, Sequence] = {}
        self._aborted: set[str] = set()
        self._rng = random.Random(seed)
        self._launch_ahead = launch_ahead and runner.can_launch
        self._launched: LaunchedStep | None = None  # running on the device, tokens not read yet

    # -- requests ---------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> None:
        """Reject what can never run, before any work: the prompt must leave room to generate."""
        n = len(request.prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens; the context window is {self.max_model_len} tokens "
                "(prompt + generated must fit)", "prompt")
        vocab = self.runner.config.vocab_size
        # every token id a request names: one past the vocabulary would index another row's logits
        for field, ids in (("prompt_token_ids", request.prompt_token_ids),
                           ("logit_bias", (t for t, _ in request.sampling.logit_bias)),
                           ("stop_token_ids", request.stopping.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {vocab})", field)
        if request.request_id in self._seqs:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        if request.sampling.prompt_logprobs is not None and not self.runner.prompt_logprobs:
            raise InvalidRequestError("is not available with tensor parallelism", "prompt_logprobs")
        if request.grammar is not None and self.grammars is None:
            raise InvalidRequestError("structured output is not available on this engine", "response_format")

    def add_request(self, request: GenerationRequest, adapter: ResidentAdapter | None,
                    grammar: CompiledGrammar | None = None) -> None:
        """Queue a checked request; ``adapter`` is a resident adapter reference (or None);
        ``grammar``: its GrammarSpec compiled already (AsyncEngine compiles off this thread),
        else compiled here."""
        self.check(request)
        if request.grammar is not None and grammar is None:
            grammar = self.grammars.compile(request.grammar)
        seed = request.sampling.seed if request.sampling.seed is not None else self._rng.getrandbits(63)
        generator = None if request.sampling.greedy else self.runner.make_generator(seed)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.skip_special_tokens)
        seq = Sequence.create(request, adapter, detok, generator)
        stopping = request.stopping
        seq.stop_ids = tuple(sorted(set(stopping.stop_token_ids) | (set() if stopping.ignore_eos else self.eos_token_ids)))
        if grammar is not None:
            seq.grammar = GrammarState(grammar, seq.stop_ids)
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Mark for removal; the stream ends with ABORT at the next step."""
        if request_id in self._seqs:
            self._aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self._seqs) or self._launched is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def adapters_in_flight(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(adapter ids of running sequences, of waiting ones), each sorted and unique; read from
        another thread (a metrics scrape) while the step loop mutates the queues, so the waiting
        queue is copied again if a step changed it mid-copy."""
        running = {s.adapter_key for s in list(self.scheduler.running)}
        waiting: set[str] = set()
        for _ in range(5):
            try:
                waiting = {s.adapter_key for s in self.scheduler.waiting}
                break
            except RuntimeError:  # "deque mutated during iteration"
                continue
        return tuple(sorted(running - {""})), tuple(sorted(waiting - {""}))

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        events = self._reap_aborted()
        launched, self._launched = self._launched, None
        if launched is None:
            batch = self.scheduler.schedule()
            if batch.empty:
                return events
            return events + self._launch_or_run(batch.seqs, batch.num_tokens)
        # launch the next step before reading this one's tokens
        batch = self.scheduler.schedule(exclude=self._ending(launched))
        ahead = None if batch.empty else self._launch(batch.seqs, batch.num_tokens, launched)
        events += self._collect(launched)
        if ahead is not None:
            return events + ahead
        # it could not run ahead: run it now that the tokens are known
        kept = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens) if s.status is not SeqStatus.FINISHED]
        if not kept:
            return events
        return events + self._launch_or_run([s for s, _ in kept], [n for _, n in kept])

    def _launch_or_run(self, seqs: list[Sequence], num_tokens: list[int]) -> list[TokenEvent]:
        launched = self._launch(seqs, num_tokens, None)
        return launched if launched is not None else self._run(seqs, num_tokens)

    def _run(self, seqs: list[Sequence], num_tokens: list[int]) -> list[TokenEvent]:
        """A step run to completion (the runner samples on the host)."""
        try:
            out = self.runner.execute(seqs, num_tokens)
        except Exception:
            log.exception("step failed; ending its %d requests with an error", len(seqs))
            return [self._finish(seq, FinishReason.ERROR) for seq in seqs]
        return self._process(seqs, num_tokens, out)

    def _launch(self, seqs: list[Sequence], num_tokens: list[int], feed: LaunchedStep | None) -> list[TokenEvent] | None:
        """Start the step on the device and keep it in ``_launched``: [] (or the error events
        of its sequences if the launch failed); None when it cannot be launched that way."""
        if not self._launch_ahead or (feed is not None and _grammar_waits(seqs)):
            return None
        try:
            step = self.runner.launch(seqs, num_tokens, feed)
        except Exception:
            log.exception("step launch failed; ending its %d requests with an error", len(seqs))
            return self._error_out(seqs)
        if step is None:
            return None
        for seq, n in zip(seqs, num_tokens):
            seq.num_computed += n
            self.scheduler.computed(seq)  # later steps run after this one on the device's stream
        for seq in step.sample_seqs:
            step.token_index.append(len(seq.token_ids))
            seq.token_ids.append(PLACEHOLDER)
        self._launched = step
        return []

    def _ending(self, launched: LaunchedStep) -> frozenset[int]:
        """Sequences whose token in ``launched`` is their last by length: not scheduled again."""
        return frozenset(
            id(seq) for seq, index in zip(launched.sample_seqs, launched.token_index)
            if index + 1 - seq.num_prompt >= seq.request.stopping.max_new_tokens or index + 1 >= self.max_model_len
        )

    def _collect(self, launched: LaunchedStep) -> list[TokenEvent]:
        """Read a launched step's tokens into its sequences and emit their events."""
        try:
            tokens = launched.token_ids()
            n = len(tokens)
            logprobs, tops = launched.logprobs.read() if launched.logprobs else ([None] * n, [None] * n)
        except Exception:
            log.exception("step failed; ending its %d requests with an error", len(launched.seqs))
            return self._error_out(launched.seqs)
        now = time.monotonic()
        events = []
        for i, (seq, index, token) in enumerate(zip(launched.sample_seqs, launched.token_index, tokens)):
            if seq.status is SeqStatus.FINISHED:  # aborted, or stopped on the token before
                continue
            seq.token_ids[index] = token
            seq.first_token = seq.first_token or now
            if not self._grammar_takes(seq, token):
                events.append(self._finish(seq, FinishReason.ERROR))
                continue
            events.append(self._token_event(seq, token, index + 1, None if logprobs[i] is None else (logprobs[i],),
                                            None if tops[i] is None else (tops[i],)))
        return events

    def _error_out(self, seqs: list[Sequence]) -> list[TokenEvent]:
        return [self._finish(seq, FinishReason.ERROR) for seq in seqs if seq.status is not SeqStatus.FINISHED]

    def _reap_aborted(self) -> list[TokenEvent]:
        events = [self._finish(self._seqs[rid], FinishReason.ABORT) for rid in self._aborted if rid in self._seqs]
        self._aborted.clear()
        return events

    def _process(self, seqs: list[Sequence], num_tokens: list[int], out: StepOutput) -> list[TokenEvent]:
        events = []
        now = time.monotonic()
        results = {id(s): i for i, s in enumerate(out.sampled_seqs)}
        for seq, n, token in zip(seqs, num_tokens, out.sampled):
            if id(seq) in out.prompt_logprobs:
                _keep_prompt_logprobs(seq, out.prompt_logprobs[id(seq)])
            seq.num_computed += n
            self.scheduler.computed(seq)
            if token is None:
                continue
            seq.first_token = seq.first_token or now
            seq.token_ids.append(token)
            if not self._grammar_takes(seq, token):
                events.append(self._finish(seq, FinishReason.ERROR))
                continue
            index = results[id(seq)]
            logprobs = None if out.result.logprobs[index] is None else (out.result.logprobs[index],)
            tops = None if out.result.top_logprobs[index] is None else (out.result.top_logprobs[index],)
            events.append(self._token_event(seq, token, len(seq.token_ids), logprobs, tops))
        return events

    @staticmethod
    def _grammar_takes(seq: Sequence, token: int) -> bool:
        """Tell a constrained sequence's grammar its new token: False if the grammar refuses it
        (the sampler's mask never lets that happen: logged, and the request fails)."""
        if seq.grammar is None or seq.grammar.accept(token):
            return True
        log.error("request %s: token %d is outside its grammar", seq.request_id, token)
        return False

    def _token_event(self, seq: Sequence, token: int, length: int, logprobs: tuple[float, ...] | None,
                     tops: tuple[dict[int, float], ...] | None) -> TokenEvent:
        """The event of ``token``, the sequence's token number ``length`` (a finishing event
        if it ends the sequence)."""
        reason = self._stop_reason(seq, token, length)
        text = ""
        if reason is None or reason is FinishReason.LENGTH:  # a stop/EOS token adds no text
            delta = seq.detokenizer.push(token)
            early = length - seq.num_prompt < seq.request.stopping.min_tokens
            text = seq.stops.feed_unchecked(delta) if early else seq.stops.feed(delta)
        if reason is not None and not seq.stops.stopped:
            text += seq.stops.feed(seq.detokenizer.flush())
            text += seq.stops.finish()
        if seq.stops.stopped:
            reason = FinishReason.STOP
        if reason is None:
            event = TokenEvent(seq.request_id, (token,), text, logprobs, tops)
        else:
            event = self._finish(seq, reason, (token,), text, logprobs, tops)
        return _with_prompt_logprobs(seq, event)

    def _stop_reason(self, seq: Sequence, token: int, length: int) -> FinishReason | None:
        stopping = seq.request.stopping
        if token in seq.stop_ids and length - seq.num_prompt > stopping.min_tokens:
            return FinishReason.STOP
        if length - seq.num_prompt >= stopping.max_new_tokens or length >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[float, ...] | None = None,
        tops: tuple[dict[int, float], ...] | None = None,
    ) -> TokenEvent:
        self.scheduler.remove(seq)
        seq.drop_placeholders()  # tokens of launched steps it no longer waits for
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.request_id]
        if seq.adapter is not None:
            self._release_adapter(seq.adapter)
        now = time.monotonic()
        timings = Timings(
            queue_s=(seq.first_scheduled or now) - seq.arrival,
            ttft_s=(seq.first_token or now) - seq.arrival,
            total_s=now - seq.arrival,
        )
        usage = Usage(seq.num_prompt, seq.num_output)
        return TokenEvent(seq.request_id, token_ids, text, logprobs, tops, reason, usage, timings)


def _grammar_waits(seqs: list[Sequence]) -> bool:
    """Whether a constrained sequence's newest token is still being sampled on the device: its
    grammar must be told that token before its next mask is filled (on the host), so the step
    cannot be launched ahead of reading it; it runs once the tokens are read (graphs still
    replay, the host's work is not overlapped for that step)."""
    return any(s.grammar is not None and s.token_ids and s.token_ids[-1] == PLACEHOLDER for s in seqs)


def _keep_prompt_logprobs(seq: Sequence, computed: PromptLogprobs) -> None:
    """Store what a prefill chunk computed of the prompt's log-probabilities (a preempted
    sequence computes its prompt again: the same positions, written again)."""
    for j, (chosen, top) in enumerate(zip(computed.chosen, computed.top)):
        seq.prompt_logprobs[computed.start + j] = (chosen, top)


def _with_prompt_logprobs(seq: Sequence, event: TokenEvent) -> TokenEvent:
    """``event`` with the prompt's log-probabilities if the request asked and they were not sent
    yet (its first token's event)."""
    if seq.prompt_logprobs is None or seq.prompt_logprobs_sent:
        return event
    seq.prompt_logprobs_sent = True
    entries = seq.prompt_logprobs
    return dataclasses.replace(event, prompt_logprobs=tuple(None if e is None else e[0] for e in entries),
                               prompt_top_logprobs=tuple(None if e is None else e[1] for e in entries))
