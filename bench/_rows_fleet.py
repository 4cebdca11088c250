"""README rows for the store, runners, pools, batches, dashboard, cluster, sandbox and fleet benchmarks."""

from __future__ import annotations

from typing import Any

from bench._report_cells import n, spread


def store_rows(d: dict[str, Any]) -> list[str]:
    ours, agl = d["ours_sqlite"], d.get("agentlightning_0_3_0")
    agl = agl if isinstance(agl, dict) else {}
    rows = fair_rows(d["fair"]) if "fair" in d else []
    when = d["machine"]["date"]
    why_memory = " — a durable write (SQLite fsync'd WAL) against a Python dict: the price of surviving kill -9"
    for key, label in [
        (
            "http_claim_complete_batched_4",
            "claim+complete/s over HTTP, 4 workers, batched (16), one run after five other phases",
        ),
        ("http_claim_complete_4", "claim+complete/s over HTTP, 4 workers, one per request"),
        ("http_claim_complete_batched_1", "claim+complete/s over HTTP, 1 worker, batched (16)"),
        ("http_claim_complete_1", "claim+complete/s over HTTP, 1 worker, one per request"),
        ("http_enqueue_4", "enqueue/s over HTTP, 4 clients"),
        ("http_enqueue_1", "enqueue/s over HTTP, 1 client"),
        ("inproc_claim_complete_batched_4", "claim+complete/s in-process, 4 workers, batched"),
        ("inproc_claim_complete_batched_1", "claim+complete/s in-process, 1 worker, batched"),
        ("inproc_claim_complete_4", "claim+complete/s in-process, 4 workers, one at a time"),
        ("inproc_claim_complete_1", "claim+complete/s in-process, 1 worker, one at a time"),
        ("inproc_enqueue_4", "enqueue/s in-process, 4 clients"),
        ("inproc_enqueue_1", "enqueue/s in-process, 1 client"),
    ]:
        if key not in ours:
            continue
        theirs = agl.get(key)
        ratio = f"{ours[key] / theirs:.2f}×" if theirs else "–"
        loses = bool(theirs) and ours[key] < theirs
        rows.append(
            f"| store | {label} (one run of {when}, 3 s, one server for every phase){why_memory if loses else ''} | {n(ours[key])} (SQLite, durable) | "
            f"{n(theirs) if theirs else '–'} (Agent Lightning 0.3.0, in memory) | {ratio} |"
        )
    lat, agl_lat = ours["dispatch_latency"], agl.get("dispatch_latency", {})
    rows.append(
        f"| store | dispatch latency p50, enqueue → claimed by an idle worker | {lat['p50_ms']:.1f} ms | "
        f"{n(agl_lat.get('p50_ms', 0))} ms (5 s polling) | "
        f"{agl_lat.get('p50_ms', 0) / lat['p50_ms']:.0f}× faster |"
    )
    pg = d.get("ours_postgres")
    if isinstance(pg, dict):
        when = f" (full run of {d['machine']['date']})" if "postgres" in d else ""
        rows.append(
            f"| store | claim+complete/s over HTTP, 4 workers, batched, PostgreSQL{when} | "
            f"{n(pg['http_claim_complete_batched_4'])} | – | – |"
        )
    pg_ab = d.get(
        "postgres"
    )  # after vs before issue 19's changes, 2 replicas vs 1: alternating rounds
    if pg_ab:

        def cell(s: dict[str, Any]) -> str:
            return f"{n(s['median'])} [{n(s['min'])}–{n(s['max'])}]"

        what = (
            f"claim+complete/s over HTTP, 4 workers, batched (16), PostgreSQL, median [range] of "
            f"{len(pg_ab['after']['rounds'])} alternating rounds ({pg_ab['machine']['date']})"
        )
        rows += [
            f"| store | {what}: this code vs commit {pg_ab['before_commit']} | {cell(pg_ab['after'])} | "
            f"{cell(pg_ab['before'])} (before) | {pg_ab['after_vs_before']:.2f}× |",
            f"| store | {what}: 2 replicas (2 clients each) vs 1 | {cell(pg_ab['after_2_replicas'])} | "
            f"{cell(pg_ab['after'])} (1 replica) | {pg_ab['replicas_2_vs_1']:.2f}× |",
        ]
        if "after_used" in pg_ab:
            rows.append(
                f"| store | {what}, on servers that have already seeded and served one such phase: this "
                f"code vs commit {pg_ab['before_commit']} | {cell(pg_ab['after_used'])} | "
                f"{cell(pg_ab['before_used'])} (before) | {pg_ab['used_after_vs_before']:.2f}× |"
            )
    return rows


FAIR_CELLS = {
    "batched_16": "claim+complete/s over HTTP, 4 workers, batched (16)",
    "one_per_request": "claim+complete/s over HTTP, 4 workers, one per request",
    "enqueue": "enqueue/s over HTTP, 4 clients, one per request",
}
FAIR_OURS = {
    "rollfleet": "claim, then complete",
    "rollfleet_handover": "complete-and-claim, one request",
}


def _cell(s: dict[str, Any]) -> str:
    return f"{n(s['median'])} [{n(s['min'])}–{n(s['max'])}]"


def fair_rows(f: dict[str, Any]) -> list[str]:
    """The fair cells (bench/_store_fair.py): rollfleet against Agent Lightning and against an
    older commit, medians [min–max] of interleaved rounds on fresh servers."""
    st = f["settings"]
    how = (
        f"median [range] of {st['rounds']} interleaved rounds, a fresh server each, "
        f"{n(st['seeded'])} queued, {st['warmup_s']:g} s warm-up, {st['window_s']:g} s window"
    )
    rows = []
    for cell, label in FAIR_CELLS.items():
        sides = f["cells"].get(cell, {})
        agl = sides.get("agl")
        seq = sides.get("agl_sequential")
        # the ratio is taken against the faster of Agent Lightning's two completion styles
        best = "agl_sequential" if seq and agl and seq["median"] > agl["median"] else "agl"
        for ours, how_ours in FAIR_OURS.items():
            if ours not in sides or agl is None:
                continue
            theirs = f"{_cell(agl)} (Agent Lightning 0.3.0, in memory"
            theirs += f", completing 16 at once; {_cell(seq)} one by one)" if seq else ")"
            what = how_ours if cell != "enqueue" else "enqueue_rollout"
            rows.append(
                f"| store | {label}, {what}: {how} | {_cell(sides[ours])} (SQLite, durable) | "
                f"{theirs} | {f['ratios'][cell][f'{ours}/{best}']['median']:.2f}× |"
            )
        if "rollfleet" in sides and "rollfleet_base" in sides:
            rows.append(
                f"| store | {label}: this code vs commit {st['base_commit']}, {how} | "
                f"{_cell(sides['rollfleet'])} | {_cell(sides['rollfleet_base'])} (before) | "
                f"{f['ratios'][cell]['rollfleet/rollfleet_base']['median']:.2f}× |"
            )
    return rows


def e2e_rows(d: dict[str, Any]) -> list[str]:
    agl = d["agentlightning_0_3_0"]
    rows = []
    for backend in ("local", "ray"):
        best = max(
            (k for k in d["ours"][backend] if k.startswith("sleep_")),
            key=lambda k: d["ours"][backend][k]["rollouts_per_s"],
        )
        ours = d["ours"][backend][best]["rollouts_per_s"]
        shape = (
            best.removeprefix("sleep_")
            .replace("_", " × ")
            .replace("n", "")
            .replace("c", "concurrency ")
        )
        rows.append(
            f"| runners | rollouts/s, 50 ms sleep agent, {backend} runners ({shape}) | {n(ours)} | "
            f"{n(agl['sleep']['rollouts_per_s'])} ({n(agl['sleep_awake']['rollouts_per_s'])} awake) "
            f"| {ours / agl['sleep']['rollouts_per_s']:.1f}× ({ours / agl['sleep_awake']['rollouts_per_s']:.1f}×) |"
        )
    like = d["ours"]["local"].get("sleep_n4_c1")
    if like:
        rows.append(
            f"| runners | like for like: rollouts/s, 50 ms sleep agent, 4 local runners × 1 rollout each, as "
            f"Agent Lightning's 4 runners | {n(like['rollouts_per_s'])} | {n(agl['sleep']['rollouts_per_s'])} "
            f"({n(agl['sleep_awake']['rollouts_per_s'])} awake) | "
            f"{like['rollouts_per_s'] / agl['sleep']['rollouts_per_s']:.1f}× "
            f"({like['rollouts_per_s'] / agl['sleep_awake']['rollouts_per_s']:.1f}×) |"
        )
    lat = d["ours"]["local"].get("dispatch_latency_n4") or d["ours"]["local"].get(
        "dispatch_latency_n1"
    )
    rows.append(
        f"| runners | idle runner dispatch p50 (enqueue → agent running) | {lat['p50_ms']:.1f} ms | "
        f"{n(agl['dispatch_latency']['p50_ms'])} ms | – |"
    )
    return rows


def pool_rows(d: dict[str, Any]) -> list[str]:
    c = d["cases"][0]
    return [
        f"| pools | tasks/s, N=5 sharing M=3, task {c['task_s']} s + reset {c['reset_s']} s | "
        f"{c['rollfleet_tasks_per_s']:.2f} ({100 * c['rollfleet_vs_bound']:.1f}% of the bound) | "
        f"{c['global_lock_tasks_per_s']:.2f} (one global lock around the pool) | {c['rollfleet_vs_global_lock']:.1f}× |"
    ]


def straggler_rows(d: dict[str, Any]) -> list[str]:
    by = {r["policy"]: r for r in d["results"]}
    co, wait, cancel = by["carry_over"], by["wait"], by["cancel"]
    return [
        f"| batches | step time, 64 log-normal tasks, min_wait 90% | {co['step_time_mean_s']:.2f} s carry_over, "
        f"{100 * co['work_kept_fraction']:.0f}% work kept | {wait['step_time_mean_s']:.2f} s wait; "
        f"{cancel['step_time_mean_s']:.2f} s cancel keeping {100 * cancel['work_kept_fraction']:.0f}% | "
        f"{co['speedup_vs_wait']:.1f}× vs wait |"
    ]


def dashboard_rows(d: dict[str, Any]) -> list[str]:
    f = d["figures"]["10000"]
    return [
        f"| dashboard | Rollouts page with 10,000 rollouts: first paint / first rows | "
        f"{f['fcp_ms_median']:.0f} / {f['first_rows_ms_median']:.0f} ms | – | target < 1 s |"
    ]


def cluster_rows(d: dict[str, Any]) -> list[str]:
    o, r, q = d["ours"], d["rlinf"], d["ratios"]

    def cell(side: dict[str, Any], key: str, digits: int = 0) -> str:
        low, high = side.get(f"{key}_range", [side[key], side[key]])
        return f"{side[key]:,.{digits}f} [{low:,.{digits}f}–{high:,.{digits}f}]"

    rounds = f"{d.get('rounds', 1)} alternating rounds, {o.get('n_small', '?')} / {o.get('n_big', '?')} items a flow on both sides"
    return [
        f"| cluster | Channel small items/s ({rounds}) | {cell(o, 'small_items_per_s')} | "
        f"{cell(r, 'small_items_per_s')} (RLinf 0.3.0) | {q['small_items_vs_rlinf']:.0f}× |",
        f"| cluster | Channel 1 MiB items, MB/s | {cell(o, 'big_mb_per_s')} | {cell(r, 'big_mb_per_s')} | "
        f"{q['big_mb_vs_rlinf']:.1f}× |",
        f"| cluster | group no-op call, ms | {cell(o, 'group_call_ms', 2)} | raw Ray "
        f"{cell(o, 'raw_ray_call_ms', 2)}; RLinf {cell(r, 'group_call_ms', 2)} | "
        f"{q['group_call_vs_raw_ray']:.2f}× raw |",
    ]


def run_rows(d: dict[str, Any]) -> list[str]:
    sides = d["sides"]
    base_name = next(name for name in sides if name.startswith("naive loop ("))
    naive = sides[base_name]

    def cell(f: dict[str, Any]) -> str:
        w, t = f["wall_s"], f["tokens_per_s"]
        return (
            f"{w['median']:.1f} s [{w['min']:.1f}–{w['max']:.1f}], {t['median']:.1f} tokens/s "
            f"[{t['min']:.1f}–{t['max']:.1f}]"
        )

    rows = []
    for name, f in sides.items():
        if name == base_name:
            continue
        rows.append(
            f"| run | `rollfleet run --mode math`, {d['tasks']} tasks × {d['max_tokens']} tokens, whole "
            f"command, {d['rounds']} alternating rounds, median [range]: {name} | {cell(f)} | "
            f"{cell(naive)} ({base_name}) | {f['tokens_per_s_vs_naive']:.2f}× "
            f"tokens/s, {f['wall_vs_naive']:.2f}× wall |"
        )
    return rows


def wire_rows(d: dict[str, Any]) -> list[str]:
    cl, ch = d["content-length"]["median"], d["chunked"]["median"]
    return [
        f"| client | µs to handle a 16-rollout claim answer (Content-Length / chunked), lean client "
        f"with its bounds and checks | {cl['ours']:.2f} / {ch['ours']:.2f} | {cl['httptools']:.2f} / "
        f"{ch['httptools']:.2f} (bare httptools, no bounds) | {cl['httptools'] / cl['ours']:.2f}× |"
    ]


def ab_rows(d: dict[str, Any]) -> list[str]:
    rows = []
    for key, label in (
        ("store", "claim+complete/s over HTTP, 4 workers, batched"),
        ("e2e", "rollouts/s, 4 local runners × 64, 50 ms sleep agent"),
    ):
        b, h = d[key]["base"], d[key]["head"]
        rows.append(
            f"| before/after | {label}: this code against commit {d['base'][:7]}, "
            f"{len(d['rounds'][key]['head'])} alternating rounds, median [range] | "
            f"{n(h['median'])} [{n(h['min'])}–{n(h['max'])}] | {n(b['median'])} "
            f"[{n(b['min'])}–{n(b['max'])}] (before) | {d[key]['ratio']:.2f}× |"
        )
    return rows


def sandbox_rows(d: dict[str, Any]) -> list[str]:
    c = d["cases"]

    def cell(name: str) -> str:
        return f"{c[name]['p50']:.1f} [{c[name]['min']:.1f}–{c[name]['max']:.1f}]"

    return [
        f"| sandbox | ms to run `print('ok')` in the py sandbox, p50 [range of {d['rounds']} alternating rounds]: "
        f"bubblewrap (isolated) vs rlimits only (`--unsafe-sandbox`) | {cell('trivial/bwrap')} | "
        f"{cell('trivial/none')} (rlimits only) | +{d['overhead_ms']:.1f} ms |",
        f"| sandbox | ms to score a solution against 3 tests: the judge under bubblewrap vs one plain unittest "
        f"run whose summary the solution could forge (before) | {cell('score/judge+bwrap')} | "
        f"{cell('score/unittest+none')} (forgeable) | "
        f"{c['score/unittest+none']['p50'] / c['score/judge+bwrap']['p50']:.2f}× |",
        f"| sandbox | ms to score the same solution with a cgroup per sandbox (memory, processes, CPU) "
        f"and a tmpfs work dir vs with neither (per-process rlimits only) | "
        f"{cell('score/judge+bwrap+cgroup')} | {cell('score/judge+bwrap')} (rlimits only) | "
        f"{c['score/judge+bwrap']['p50'] / c['score/judge+bwrap+cgroup']['p50']:.2f}× |",
        f"| sandbox | ms to start, reset and stop one sandbox: with its cgroup and tmpfs vs without | "
        f"{cell('lifecycle/bwrap+cgroup')} | {cell('lifecycle/bwrap')} (without) | "
        f"+{c['lifecycle/bwrap+cgroup']['p50'] - c['lifecycle/bwrap']['p50']:.1f} ms |",
    ]


def chaos_rows(d: dict[str, Any]) -> list[str]:
    calm, chaos = d["sides"]["calm"], d["sides"]["chaos"]

    def cell(s: dict[str, Any]) -> str:
        t = s["throughput_per_s"]
        return spread(t, unit="/s")

    return [
        f"| chaos | rollouts/s, 1,000 sleep rollouts (0.2–1.5 s) on 4 runners x 4, a runner SIGKILLed every "
        f"~2 s (random) and the server restarted once, vs the same run without kills, median [range] of "
        f"{d['settings']['rounds']} alternating rounds; failed / succeeded twice: "
        f"{sum(chaos['failed'])} / {sum(chaos['succeeded_twice'])} | {cell(chaos)} | {cell(calm)} (no kills) | "
        f"{d['chaos_vs_calm']:.2f}× (goal ≥ 0.5) |"
    ]


def fleet_rows(d: dict[str, Any]) -> list[str]:
    """One row per runner count: 2 replicas against 1 on PostgreSQL (bench/fleet.py)."""
    by = {(p["runners"], p["replicas"]): p for p in d["points"]}

    def cell(p: dict[str, Any]) -> str:
        # runners that claim with each completion send no claim apart once they run
        call = "complete" if p.get("complete_and_claim") else "claim"
        med = {
            k: p[k]["median"]
            for k in (f"{call}_p50_ms", f"{call}_p99_ms", "server_cpu", "error_count")
        }
        c = p["completions_per_s"]
        what = "claim" if call == "claim" else "complete-and-claim"
        return (
            f"{c['median']:,.0f} [{c['min']:,.0f}–{c['max']:,.0f}]/s, {what} p50 / p99 {med[f'{call}_p50_ms']:,.1f} "
            f"/ {med[f'{call}_p99_ms']:,.0f} ms, server {med['server_cpu']:.2f} cores, {med['error_count']:,.0f} errors"
        )

    rows = []
    for runners in sorted({r for r, _ in by}):
        one, two = by.get((runners, 1)), by.get((runners, 2))
        if not one or not two:
            continue
        ratio = two["completions_per_s"]["median"] / max(one["completions_per_s"]["median"], 1e-9)
        limit = (
            one.get("max_connections") or 2048
        )  # points measured before --max-connections had 2,048
        retry = "backing off after" if one.get("max_connections") else "retrying 0.5 s after"
        if one.get("complete_and_claim"):
            retry = f"each completion claiming the next rollout, {retry}"
        rows.append(
            f"| fleet | completions/s of {runners:,} simulated runners (agent 0.5–2 s, one long-poll "
            f"connection each, {retry} a failed claim) on PostgreSQL, servers' connection "
            f"limit {limit:,}, median [range] of {one['rounds']} alternating rounds of "
            f"{d['seconds_per_point']:.0f} s, 2 cores shared by servers, PostgreSQL and clients "
            f"([docs/scale.md](scale.md)) | 2 replicas: {cell(two)} | 1 replica: {cell(one)} | "
            f"{ratio:.2f}× |"
        )
    return rows


def envs_rows(d: dict[str, Any]) -> list[str]:
    """An OpenEnv server through the openenv mode's session against OpenEnv's own client."""
    rows, steps, rounds = [], d["steps_per_episode"], d["rounds"]
    for key, what, digits in (
        ("p50_ms", "ms per environment step, p50", 3),
        ("p99_ms", "ms per environment step, p99", 3),
        ("eps_1", f"{steps}-step scripted episodes/s, one at a time", 0),
        (
            f"eps_{d['concurrent']}",
            f"{steps}-step scripted episodes/s, {d['concurrent']} at once",
            0,
        ),
    ):
        ours, theirs = d[key]["rollfleet"], d[key]["openenv"]
        rows.append(
            f"| envs | {what}: an OpenEnv server (openenv-core, loopback) through the openenv mode "
            f"vs OpenEnv's `GenericEnvClient`, median [range] of {rounds} alternating rounds | "
            f"{spread(ours, digits)} | {spread(theirs, digits)} (GenericEnvClient) | "
            f"{ours['median'] / theirs['median']:.2f}× |"
        )
    return rows
