"""The summary file a bench/server script keeps beside what it prints
(load_matrix.py, probe.py, session_matrix.py, prefill_interference.py)."""


def summary_emitter(path):
    """Empties `path` and returns emit(text), which prints text and appends it
    to `path` as one line, so the summary survives a scrolled-away terminal."""
    path.write_text("")

    def emit(text):
        print(text, flush=True)
        with open(path, "a") as f:
            f.write(text + "\n")

    return emit
