"""Why a `layerctl bench` run failed, from its JSON report: the count of each
error code and the first message the client kept for it
(`errors_by_code`, `first_error_by_code`). The server scripts beside this
file print these lines under a row with failures.
"""


def error_lines(report, indent="    "):
    """One line per error code of a report (a dict read from its JSON):
    `CODE xN: first message`; none when nothing failed. Reports written
    before first_error_by_code existed give the counts alone."""
    first = report.get("first_error_by_code", {})
    lines = []
    for code, count in sorted(report.get("errors_by_code", {}).items()):
        message = first.get(code, "")
        lines.append(f"{indent}{code} x{count}" + (f": {message}" if message else ""))
    return lines


def merged_error_lines(reports, indent="    "):
    """error_lines over several reports of one row (one per client): counts
    summed, the first message of the first report that has the code."""
    counts, first = {}, {}
    for report in reports:
        for code, count in report.get("errors_by_code", {}).items():
            counts[code] = counts.get(code, 0) + count
        for code, message in report.get("first_error_by_code", {}).items():
            first.setdefault(code, message)
    return error_lines({"errors_by_code": counts, "first_error_by_code": first}, indent)
