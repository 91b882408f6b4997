"""The generation loop every API family shares (OpenAI, TGI, vLLM, Triton): submit a request to
a device worker and turn its frames into ``Piece``s of ids, text and log-probabilities, with stop
strings applied and MindIE's deadlines kept.

Stop strings are matched on the decoded text. ``StopMatcher`` holds back the end of the text that
could still be the start of a stop string, so no stop text ever reaches a client (unless asked
with ``include_stop``), even one split across tokens; the moment one matches the request is
cancelled on its worker. Stop token ids are the worker's job (``SamplingParams.stop_token_ids``,
finish reason ``stop_token``), and so are log-probabilities (``SamplingParams.logprobs``).

Every family uses it, the native ``/infer`` route included (its codec renders each piece's
tokens as MindIE's per-token frames, with the piece's timings; it asks for no text here, since
it decodes token by token itself). Errors are ``ApiError`` (mindie/contract/http_error.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from mindie.contract import wire as P
from mindie.contract.errors import FINISH_STOP, UnknownAdapterError
from mindie.device_client import DeviceClient, NoWorkerError
from mindie.text.detokenizer import IncrementalDetokenizer, TextTokenizer
from mindie.contract.http_error import ApiError
from mindie.sse import IDLE_TICK_S


class StopMatcher:
    """Stop strings on streamed text (``push`` the new text of each step)."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop
        self.held = ""
        self.longest = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, str | None]:
        """(text that may be sent now, the stop string that matched or None). After a match
        nothing more may be pushed."""
        if not self.stops:
            return text, None
        buf = self.held + text
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.held = ""
            return buf[: i + len(s)] if self.include else buf[:i], s
        keep = 0
        for k in range(min(len(buf), self.longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """The held text, once the request ended without a match."""
        out, self.held = self.held, ""
        return out


class Piece:
    """What one step added to a request (a plain slotted class: one is made per token frame)."""

    __slots__ = ("token_ids", "text", "logprobs", "top_logprobs", "finish_reason", "stop", "prefill_ms",
                 "decode_ms", "prompt_logprobs", "spec", "embedding")

    def __init__(self, token_ids: list[int], text: str, logprobs: list[float] = (),
                 top_logprobs: list[list[tuple[int, float]]] = (), finish_reason: str = "", stop: str | None = None,
                 prefill_ms: float = 0.0, decode_ms: float = 0.0, prompt_logprobs: list[float] = ()):
        self.token_ids = token_ids
        self.text = text
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.finish_reason = finish_reason  # "" while running; eos_token, length, stop_sequence, stop_token, stop
        self.stop = stop  # the stop string that ended it
        self.prefill_ms = prefill_ms
        self.decode_ms = decode_ms
        self.prompt_logprobs = prompt_logprobs  # first piece, when asked
        self.spec = (0, 0)  # speculative decoding in its step: (tokens proposed, accepted)
        self.embedding = b""  # a pooling request's vector (wire.TokenFrame.embedding), on its only piece


class Deadline:
    """min(client timeout, tokenTimeout) since the last token (streams) or the start, and
    e2eTimeout since the start, as the native route keeps them (mindie.md §4.2)."""

    def __init__(self, timeout: float | None, token_timeout: float, e2e_timeout: float, stream: bool):
        self.start = time.monotonic()
        self.mark = self.start
        self.timeout = timeout
        self.token_timeout = token_timeout
        self.e2e_end = self.start + e2e_timeout
        self.stream = stream

    def token(self) -> None:
        if self.stream:
            self.mark = time.monotonic()

    def next(self) -> tuple[float, str]:
        cands = [(self.mark + self.token_timeout, "server tokenTimeout"), (self.e2e_end, "server e2eTimeout")]
        if self.timeout is not None:
            cands.append((self.mark + self.timeout, "client timeout"))
        return min(cands)


class Generation:
    """One request on a device worker; iterate ``pieces()``."""

    def __init__(self, client: DeviceClient, tokenizer: TextTokenizer, input_ids: list[int],
                 params: P.SamplingParams, deadline: Deadline, *, priority: int = 5, user_id: str = "",
                 stops: Sequence[str] = (), include_stop: bool = False, detokenize: bool = True,
                 adapter: str = "", keep_special: frozenset[int] = frozenset(), pd: P.PdOrder | None = None):
        """``detokenize`` False: pieces carry ids only (no text, no stop strings); ``adapter``: the
        LoRA adapter it runs with ("" = the base model); ``keep_special``: special ids whose text
        the pieces keep (a tool-call format's delimiters)."""
        self.client = client
        self.tokenizer = tokenizer
        self.input_ids = input_ids
        self.params = params
        self.deadline = deadline
        self.detok = IncrementalDetokenizer(tokenizer, keep_special) if detokenize else None
        self.matcher = StopMatcher(stops, include_stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = ""
        self.t0 = time.monotonic()
        self.ttft_s: float | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache served (the first frame says)
        try:
            extra = {"adapter": adapter} if adapter else {}  # (clients without LoRA take no such argument)
            if pd is not None:
                extra["pd"] = pd  # prefill/decode disaggregation (mindie/contract/pd.py)
            self.stream = client.submit(input_ids, params, priority, user_id=user_id, **extra)
        except NoWorkerError as e:
            raise ApiError(503, f"No device worker is ready: {e}") from None
        except UnknownAdapterError as e:  # unloaded since the request was parsed
            raise ApiError(404, str(e)) from None
        self.request_id = self.stream.request_id

    async def pieces(self, tick: bool = False) -> AsyncIterator[Piece | None]:
        """Pieces as steps finish; the last has ``finish_reason``. With ``tick``, None every
        IDLE_TICK_S while nothing comes (an SSE writer then notices a vanished client). Raises
        ApiError (the request is cancelled on its worker first)."""
        try:
            while not self.finish_reason:
                deadline, desc = self.deadline.next()
                wait = deadline - time.monotonic()
                if tick:
                    wait = min(wait, IDLE_TICK_S)
                frames = await self.stream.get(max(0.0, wait))
                if not frames:
                    if self.stream.cancelled:  # cancelled by this front end: nothing more comes
                        return
                    if self.stream.finished:  # (get returns every frame it has: never expected)
                        raise ApiError(500, "Internal error: the request's stream ended without its last frame")
                    if time.monotonic() >= deadline:
                        raise ApiError(500, f"Engine callback timeout: {desc}", timeout=True)
                    if tick:
                        yield None
                    continue
                self.deadline.token()
                for f in frames:
                    for piece in self._pieces(f):
                        yield piece
                    if self.finish_reason:
                        break
        finally:
            if not self.stream.finished:
                self.client.cancel(self.stream)

    def _pieces(self, f: P.TokenFrame) -> list[Piece]:
        """The frame's pieces: one, or with text one per token. A speculative step's frame carries
        every token it accepted; split, each token gets its own text (TGI streams show it per
        token) and a stop string ends the request at the token that completes it, the tokens after
        it dropped (ids, log-probabilities, counts), exactly as without speculation."""
        if f.token_ids and not self.token_ids:  # the first token's frame (a PD decode instance's later ones: not)
            self.cached_tokens = f.cached_tokens
        n = len(f.token_ids)
        if n <= 1 or self.detok is None:
            piece = self._piece(f)
            return [] if piece is None else [piece]
        out = []
        for i in range(n):
            last = i == n - 1
            sub = P.TokenFrame(
                f.request_id, f.token_ids[i:i + 1], f.finish_reason if last else "",
                f.prefill_ms if i == 0 else 0.0, f.decode_ms / n,
                logprobs=f.logprobs[i:i + 1], top_logprobs=f.top_logprobs[i:i + 1],
                prompt_logprobs=f.prompt_logprobs if i == 0 else [],
                spec_draft=f.spec_draft if i == 0 else 0, spec_accepted=f.spec_accepted if i == 0 else 0)
            piece = self._piece(sub)
            if piece is not None:
                out.append(piece)
            if self.finish_reason:  # a stop string: the rest of the step's tokens are not the answer's
                break
        return out

    def _piece(self, f: P.TokenFrame) -> Piece | None:
        if f.error is not None:
            raise ApiError(f.error.status, f.error.message, f.error.error_type)
        if f.token_ids and self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.t0
        self.token_ids.extend(f.token_ids)
        if self.detok is None:
            self.finish_reason = f.finish_reason
            if not (f.token_ids or f.finish_reason):
                return None
            # The frame's lists are this request's alone (decoded for it): no copies.
            p = Piece(f.token_ids, "", f.logprobs, f.top_logprobs, f.finish_reason, None, f.prefill_ms,
                      f.decode_ms, f.prompt_logprobs)
            if f.spec_draft:
                p.spec = (f.spec_draft, f.spec_accepted)
            if f.embedding:
                p.embedding = f.embedding
            return p
        text, stop = self.matcher.push(self.detok.push(f.token_ids))
        if stop is None and f.finish_reason:
            more, stop = self.matcher.push(self.detok.flush())
            text += more if stop is not None else more + self.matcher.flush()
        finish = f.finish_reason
        if stop is not None:
            finish = FINISH_STOP
            if not f.finish_reason:
                self.client.cancel(self.stream)  # ends it on its worker now
        self.text += text
        self.finish_reason = finish
        if not (f.token_ids or text or finish):
            return None
        p = Piece(f.token_ids, text, f.logprobs, f.top_logprobs, finish, stop, f.prefill_ms, f.decode_ms,
                  f.prompt_logprobs)
        if f.spec_draft:
            p.spec = (f.spec_draft, f.spec_accepted)
        return p
