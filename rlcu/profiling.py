"""Where a GRPO step's GPU time goes: the kernels of each phase (the module marks its phases with
`torch.profiler.record_function("rlcu/<phase>")`), summed by name, beside the phase's wall time. The
difference between the two is time the GPU sat idle waiting for the host.

    rlcu bench step --prompts 8 --generations 8 --profile prof/

prints the table and writes prof/trace.json (open it in https://ui.perfetto.dev)."""
from __future__ import annotations

import os
from collections import defaultdict

import torch

PREFIX = "rlcu/"


def phase_kernels(prof: torch.profiler.profile) -> dict[str, dict]:
    """{phase: {"wall_ms", "busy_ms", "kernels": {name: (ms, count)}, "host": {name: (ms, count)}}} from a
    finished profile: the GPU kernels and the host's operators (self time, as the profiler inflates it)
    of each phase. An event belongs to the phase whose range (host time) holds its start: each phase ends
    on a synchronisation, so its kernels have run before the next phase's range opens."""
    events = prof.events()
    ranges, seen = [], defaultdict(int)
    for e in sorted((e for e in events if e.name.startswith(PREFIX) and e.device_type == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.time_range.start):
        name = e.name[len(PREFIX):]
        seen[name] += 1  # a profile of several steps holds each phase once a step: "train", "train 2", ...
        ranges.append((name if seen[name] == 1 else f"{name} {seen[name]}", e.time_range.start, e.time_range.end))
    out = {name: {"wall_ms": (end - start) / 1e3, "busy_ms": 0.0, "kernels": defaultdict(lambda: [0.0, 0]),
                  "host": defaultdict(lambda: [0.0, 0])} for name, start, end in ranges}
    for e in events:
        if e.name.startswith(PREFIX):  # the ranges themselves
            continue
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        for name, start, end in ranges:
            if start <= e.time_range.start < end:
                ms = (e.time_range.end - e.time_range.start) / 1e3 if on_gpu else e.self_cpu_time_total / 1e3
                if on_gpu:
                    out[name]["busy_ms"] += ms
                k = out[name]["kernels" if on_gpu else "host"][e.name]
                k[0], k[1] = k[0] + ms, k[1] + 1
                break
    return out


def print_phase_kernels(phases: dict[str, dict], top: int = 15, file=None) -> None:
    for name, p in phases.items():
        print(f"\n{name}: {p['wall_ms']:.0f} ms wall, GPU busy {p['busy_ms']:.0f} ms "
              f"({100 * p['busy_ms'] / max(p['wall_ms'], 1e-9):.0f}%)", file=file)
        for kernel, (ms, n) in sorted(p["kernels"].items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {ms:9.1f} ms {n:7d}x  {kernel[:110]}", file=file)
        print("  host operators, self time:", file=file)
        for op, (ms, n) in sorted(p["host"].items(), key=lambda kv: -kv[1][0])[:top // 2]:
            print(f"  {ms:9.1f} ms {n:7d}x  {op[:110]}", file=file)


def profiler(out_dir: str) -> torch.profiler.profile:
    os.makedirs(out_dir, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)
