"""Files of a run folder that one process writes and another follows: the learner writes them, `tidal run`
prints them as they grow."""

from __future__ import annotations

NOTICES_FILE = "notices.log"  # lines a user must see while the run goes on, one each
ROLLOUTS_FILE = "rollouts.jsonl"  # a line per rollout table (what `tidal run --print-samples` shows)


def rollout_text(row: dict, width: int = 160) -> str:
    """One rollout table row as a console line: its numbers, then its prompt and completion truncated
    to `width` characters each, newlines shown as \\n."""

    def short(text: str) -> str:
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 3] + "..."

    components = "".join(f" {key}={value:.3g}" for key, value in row.items() if key.startswith("reward/"))
    return (
        f"[rollout] step {row['step']} reward={row['reward']:.3g}{components} advantage={row['advantage']:+.3f} "
        f"versions={row['versions']} lag={row['lag']} {row['finish_reason']}\n"
        f"  prompt: {short(row['prompt'])}\n  completion: {short(row['completion'])}"
    )
