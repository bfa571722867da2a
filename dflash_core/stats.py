"""What one generation did, as every response's `dflash` object and `dflash bench` report it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional


@dataclass
class GenerationStats:
    """What one generation did; documented key by key in README.md ("Statistics")."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    generated_tokens: int = 0
    speculative: bool = False
    speculative_off_reason: Optional[str] = None
    block_size: int = 0
    speculation: Optional[str] = None  # the mode asked for: auto, on or off
    cycles: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    verified_by_position: list[int] = field(default_factory=list)  # cycles whose width reached each position
    cycle_widths: dict[int, int] = field(default_factory=dict)  # width -> cycles run at it
    plain_steps: int = 0  # target steps of one token within a speculating generation
    tokens_from_cycles: int = 0
    tokens_from_steps: int = 0
    speculation_note: Optional[str] = None  # auto: why it last chose plain steps, in numbers

    @property
    def tokens_per_cycle(self) -> float:
        """Tokens committed per verify cycle: accepted drafts plus the target's own token."""
        return (self.draft_tokens_accepted + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of the cycles verifying block position i (1..B-1) in which its draft was accepted."""
        return [n / v if v else 0.0 for n, v in zip(self.accepted_by_position, self.verified_by_position)]

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes from prefill; decode time covers the rest.
        if self.generated_tokens <= 1 or self.decode_seconds <= 0:
            return 0.0
        return (self.generated_tokens - 1) / self.decode_seconds

    def record_cycle(self, accepted: int, width: Optional[int] = None) -> None:
        width = width or self.block_size
        self.cycles += 1
        self.cycle_widths[width] = self.cycle_widths.get(width, 0) + 1
        self.draft_tokens_proposed += width - 1
        self.draft_tokens_accepted += accepted
        for i in range(width - 1):
            self.verified_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    def copy(self) -> "GenerationStats":
        """A snapshot: the live object keeps changing while the generation runs."""
        return replace(self, accepted_by_position=list(self.accepted_by_position),
                       verified_by_position=list(self.verified_by_position), cycle_widths=dict(self.cycle_widths))

    def as_dict(self) -> dict:
        out = asdict(self)
        out["tokens_per_cycle"] = self.tokens_per_cycle
        out["acceptance_by_position"] = self.acceptance_by_position
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        return out
