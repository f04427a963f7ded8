"""tp_speed's table: each variant's decode time beside standard's, the ratios, and what
communication costs standard (rows measured in one run)."""

from __future__ import annotations

STANDARD, BOUND = "standard", "no-comm bound"  # the variants every other is compared with


def add_ratios(rows: list[dict]) -> list[dict]:
    """Per (link, batch): speed-up over standard, share of the bound's gain, and the communication share."""
    summaries = []
    for key in dict.fromkeys((row["link"], row["batch"]) for row in rows):
        group = [row for row in rows if (row["link"], row["batch"]) == key]
        standard = next(row for row in group if row["variant"] == STANDARD)["decode_ms_per_token"]
        bound = next((row["decode_ms_per_token"] for row in group if row["variant"] == BOUND), None)
        # A bound within 2% of standard leaves no gain to share out: the ratio would be noise.
        bound_gain = standard - bound if bound is not None and standard - bound > 0.02 * standard else None
        for row in group:
            row["speedup_vs_standard"] = standard / row["decode_ms_per_token"]
            row["share_of_bound_gain"] = (standard - row["decode_ms_per_token"]) / bound_gain if bound_gain else None
        summaries.append(
            dict(
                link=key[0],
                batch=key[1],
                communication_share_of_standard=None if bound is None else 1 - bound / standard,
            )
        )
    return summaries


def table(rows: list[dict], summaries: list[dict]) -> str:
    header = f"{'link':<10} {'batch':>5}  {'variant':<18} {'decode ms/tok':>13} {'spread':>6} {'tok/s':>8} {'vs standard':>11} {'bound gain':>10} {'prefill ms':>10}"
    lines = [header, "-" * len(header)]
    for summary in summaries:
        for row in rows:
            if (row["link"], row["batch"]) != (summary["link"], summary["batch"]):
                continue
            share = row["share_of_bound_gain"]
            lines.append(
                f"{row['link']:<10} {row['batch']:>5}  {row['variant'] + (' *' if row['variant'] == BOUND else ''):<18} "
                f"{row['decode_ms_per_token']:>13.2f} {row['decode_spread']:>6.0%} {row['tokens_per_s']:>8.1f} "
                f"{row['speedup_vs_standard']:>10.2f}x {'n/a' if share is None else f'{share:.0%}':>10} {row['prefill_ms']:>10.1f}"
            )
        if summary["communication_share_of_standard"] is not None:
            lines.append(
                f"{summary['link']:<10} {summary['batch']:>5}  communication share of standard decode (1 - bound/standard): {summary['communication_share_of_standard']:.0%}"
            )
        lines.append("")
    lines.append(
        f"* {BOUND}: all-reduces skipped, so its OUTPUTS ARE WRONG; it only times a free interconnect.\n"
        "spread: (max - min) / median over the repeats; bound gain: (standard - variant) / (standard - bound), "
        "n/a when the bound is within 2% of standard."
    )
    return "\n".join(lines)


__all__ = ["BOUND", "STANDARD", "add_ratios", "table"]
