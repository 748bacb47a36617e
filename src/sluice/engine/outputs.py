"""What a request gives back: each prompt's RequestOutput, and the Stats of the last request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # includes a final eos / stop token
    finish_reason: str | None = None  # "stop" (eos, stop token or stop string) or "length"
    prompt: str | None = None
    logprobs: list | None = None  # engine.logprobs.TokenLogprob per generated token, when params.logprobs asked
    # when params.prompt_logprobs asked: None for the first prompt token, then a TokenLogprob per prompt token
    prompt_logprobs: list | None = None


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    fused_head_steps: int = 0  # tokens sampled through the fused LM head (the rest took the plain one)
    fallback_rate: float = 0.0  # of the filtered rows on the fused head, the fraction that fell back
    rows: int = 1  # prompts in the batch: each row's first token comes out of prefill
    speculative: str = "off"  # "draft" or "prompt-lookup": the fields below count its rounds
    proposed: int = 0  # guesses the proposer made for rows still generating
    accepted: int = 0  # of those, kept by the acceptance rule
    target_forwards: int = 0  # decode forwards of the target (a verify or a plain step each)
    row_forwards: int = 0  # the same, counted once per row still generating

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Decode tokens a row gets per target forward: 1 for plain decoding, up to k+1 speculating."""
        return max(self.generated_tokens - self.rows, 0) / self.row_forwards if self.row_forwards else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        # Each row's first generated token comes out of prefill; the rest are decode steps.
        steps = max(self.generated_tokens - self.rows, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "prefill_seconds": round(self.prefill_seconds, 4),
                "decode_seconds": round(self.decode_seconds, 4),
                "prefill_tok_s": round(self.prefill_tok_s, 2), "decode_tok_s": round(self.decode_tok_s, 2),
                "fused_head_steps": self.fused_head_steps, "fallback_rate": round(self.fallback_rate, 4),
                **({} if self.speculative == "off" else {
                    "speculative": self.speculative, "proposed": self.proposed, "accepted": self.accepted,
                    "acceptance_rate": round(self.acceptance_rate, 4), "target_forwards": self.target_forwards,
                    "tokens_per_forward": round(self.tokens_per_forward, 3)})}
