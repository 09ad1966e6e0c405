"""CPU time of a running process's threads, charged to roles by thread name,
and of this process's finished children (the benchmark clients).

The server names its threads by what they do (base/thread_name.h:
grpc-cq-0, batcher, reply-2, stream-1, copy0-3, cpu-op-5, metrics-http);
a role is the name without its index. Threads the server did not name
(gRPC core's own, the main thread) keep the process's name. Linux only
(/proc/PID/task/TID/stat); where there is no /proc, snapshots are empty.
"""

import os
import re
import resource
from collections import defaultdict

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot(pid):
    """{tid: (name, CPU seconds so far, user + system)} for each thread of pid."""
    threads = {}
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return threads
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        # "tid (name) state ...": the name may hold spaces and parentheses,
        # so it ends at the last ')'. utime and stime are the 14th and 15th
        # fields of the line, the 12th and 13th after the name.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        threads[tid] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return threads


def role(name):
    """'grpc-cq-3' -> 'grpc-cq', 'copy0-2' -> 'copy', 'batcher' -> 'batcher'."""
    return re.sub(r"[-\d]+$", "", name) or name


def seconds_by_role(before, after):
    """{role: CPU seconds} its threads spent between two snapshots, largest
    first. A thread that started in between counts whole; one that ended in
    between is missing (the kernel forgets its counts)."""
    spent = defaultdict(float)
    for tid, (name, seconds) in after.items():
        spent[role(name)] += seconds - before.get(tid, (name, 0.0))[1]
    return dict(sorted(spent.items(), key=lambda item: -item[1]))


def children_cpu_seconds():
    """CPU seconds (user + system) of this process's children that have ended
    and been waited for: the clients a script ran."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def per_request_line(server_label, server_cpu, client_seconds, requests):
    """'cpu us per request: server 141 (grpc-cq 52 reply 31 ...) client 63':
    seconds_by_role's result and the client's CPU seconds over `requests`
    (roles under half a microsecond left out)."""
    per_request = {name: 1e6 * seconds / requests for name, seconds in server_cpu.items()}
    parts = " ".join(f"{name} {us:.0f}" for name, us in per_request.items() if us >= 0.5)
    return (f"cpu us per request: {server_label} {sum(per_request.values()):.0f} ({parts}) "
            f"client {1e6 * client_seconds / requests:.0f}")
