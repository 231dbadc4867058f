"""The checks scripts/compose-test runs against the compose stack, static and live.

    compose_checks.py static ROOT                      the dashboard and Grafana's provisioning;
                                                       Prometheus' rule files mounted
    compose_checks.py outputs FILE N STATUS [KIND]     `vramgate-cli watch --json` output
    compose_checks.py prometheus URL JOB...            every job scraped, `up` == 1; the alerting
                                                       rules loaded and evaluated without error
    compose_checks.py metrics ROOT URL...              dashboard metrics exist in live /metrics
    compose_checks.py jaeger URL [SERVICE]             Jaeger's API answers (and has SERVICE)
    compose_checks.py products FILE FOLDER             the product segmentor's results: person
                                                       boxes, both masks stored; the masks fetched
                                                       into FOLDER are PNGs of the picture's size
                                                       with the SHA-256 the result gives
    compose_checks.py load FILE N KIND FOLDER          `vramgate-cli load --json` output: N events,
                                                       each a result or a KIND dead letter, 0 lost;
                                                       its CSV and PNG in FOLDER

Each prints what it checked and exits 1 with the reason on the first failure. Waits are bounded
by deadlines; HTTP calls by timeouts. Standard library only, plus PyYAML for `static`.
"""

import json
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

HTTP_TIMEOUT_S = 5
DASHBOARD = "deploy/grafana/dashboards/vramgate.json"
DOCKERFILE = "docker/vramgate.Dockerfile"
# A metric selector in PromQL as the dashboard writes them: always with braces.
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")


def fail(message):
    print(f"compose-check: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def say(message):
    print(f"compose-check: {message}", file=sys.stderr)


def get(url):
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
        return response.status, response.read().decode()


def poll(what, deadline_s, attempt):
    """Calls attempt() until it returns a true value or deadline_s pass; returns that value."""
    deadline = time.monotonic() + deadline_s
    last = None
    while True:
        try:
            value = attempt()
            if value:
                return value
        except Exception as error:  # a service still starting: connection refused, 503, bad JSON
            last = error
        if time.monotonic() >= deadline:
            fail(f"{what} within {deadline_s} s (last error: {last})")
        time.sleep(1)


def dashboard_exprs(root):
    dashboard = json.loads((root / DASHBOARD).read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return dashboard, exprs


def static(root):
    import yaml

    dashboard, exprs = dashboard_exprs(root)
    if not exprs:
        fail(f"{DASHBOARD} queries nothing")
    datasources = yaml.safe_load((root / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"]}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            uid = target.get("datasource", {}).get("uid")
            if uid not in uids:
                fail(f"panel '{panel['title']}' uses data source {uid}, not a provisioned one ({sorted(uids)})")
            if not SELECTOR.search(target["expr"]):
                fail(f"panel '{panel['title']}' has no metric selector with braces: {target['expr']}")
    providers = yaml.safe_load((root / "deploy/grafana/provisioning/dashboards/vramgate.yml").read_text())
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    for provider in providers["providers"]:
        path = provider["options"]["path"]
        if f"./deploy/grafana/dashboards:{path}:ro" not in mounts:
            fail(f"the dashboard provider reads {path}, which docker-compose.yml does not mount")
    say(f"{DASHBOARD} parses: {len(dashboard['panels'])} panels, {len(exprs)} queries; provisioning matches")
    # Prometheus reads its rule files at the paths prometheus.yml names, inside the container.
    config = yaml.safe_load((root / "deploy/prometheus/prometheus.yml").read_text())
    prometheus_mounts = compose["services"]["prometheus"]["volumes"]
    rule_files = config.get("rule_files") or []
    if not rule_files:
        fail("deploy/prometheus/prometheus.yml loads no rule files (deploy/prometheus/alerts.yml)")
    for path in rule_files:
        if f"./deploy/prometheus/{Path(path).name}:{path}:ro" not in prometheus_mounts:
            fail(f"prometheus.yml reads rules from {path}, which docker-compose.yml does not mount")
    say(f"prometheus.yml's rule files are mounted: {', '.join(rule_files)}")
    # The CUDA worker image cannot be built here (no registry for its base, no GPU); it must do
    # exactly what the CPU image, which is built and run, does.
    stages = dockerfile_stages(root / DOCKERFILE)
    cpu, cuda = (worker_steps(stages[name]) for name in ("worker", "worker-cuda"))
    if cpu != cuda:
        diff = [f"{a!r} / {b!r}" for a, b in zip(cpu, cuda) if a != b] or ["different lengths"]
        fail(f"{DOCKERFILE}: the worker-cuda stage differs from the worker stage beyond base and device: {diff[0]}")
    say(f"{DOCKERFILE}: worker-cuda is the CPU worker's {len(cpu)} steps on the CUDA base")
    # Every ARG default that scripts/versions.env also pins must be its value there.
    pinned = dict(re.findall(r"^([A-Z0-9_]+)=(\S+)$", (root / "scripts/versions.env").read_text(), re.M))
    args = re.findall(r"^ARG ([A-Z0-9_]+)=(\S*)$", (root / DOCKERFILE).read_text(), re.M)
    checked = 0
    for name, value in args:
        if name in pinned:
            checked += 1
            if value != pinned[name]:
                fail(f"{DOCKERFILE}: ARG {name}={value}, but scripts/versions.env pins {pinned[name]}")
    say(f"{DOCKERFILE}: its {checked} pinned build arguments are scripts/versions.env's")


def dockerfile_stages(path):
    """A Dockerfile's stages, by name: each a list of its instructions, continuation lines joined
    and comments left out, the FROM line first."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    stages, current = {}, None
    for line in text.splitlines():
        line = " ".join(line.split())
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM \S+(?: AS (\S+))?$", line, re.I)
        if m:
            current = stages.setdefault(m.group(1) or f"stage-{len(stages)}", [])
        if current is not None:
            current.append(line)
    return stages


def worker_steps(steps):
    """A worker stage's instructions with the base image, NVIDIA's variables, the device, the
    title and description, and the start period taken out: what the CPU and CUDA images share."""
    out = []
    for line in steps:
        line = re.sub(r"^FROM \S+ AS \S+", "FROM <base>", line)
        line = re.sub(r"NVIDIA_\S+=\S+ ", "", line)
        line = re.sub(r"VRAMGATE_WORKER_DEVICE=\S+", "VRAMGATE_WORKER_DEVICE=<device>", line)
        line = re.sub(r'org\.opencontainers\.image\.(title|description)="[^"]*"', r"\1", line)
        out.append(" ".join(re.sub(r"--start-period=\S+", "", line).split()))
    return out


def outputs(path, count, status, kind=None):
    """Every line of `watch --json` output is a result (status ok) or a dead letter of KIND."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if len(records) != count:
        fail(f"{path}: {len(records)} records, expected {count}")
    for record in records:
        if status == "ok" and record.get("status") != "ok":
            fail(f"{record.get('id')} did not reach the results topic as ok: {json.dumps(record)[:300]}")
        if status == "dead_letter" and record.get("error", {}).get("kind") != kind:
            fail(f"{record.get('id')} is not a dead letter of kind {kind}: {json.dumps(record)[:300]}")
    say(f"{path}: {count} records, all {status}{' ' + kind if kind else ''}")


# The product segmentor's stored outputs (config/products.toml: `<stage>.<row>`).
PRODUCT_MASKS = ("foreground.mask", "people_masks.mask")


def mask_uris(path):
    """The stored masks' URIs in `watch --json` output of the products task, one per line."""
    for line in Path(path).read_text().splitlines():
        if line.strip():
            outputs = json.loads(line).get("output", {}).get("outputs", {})
            for name in PRODUCT_MASKS:
                if isinstance(outputs.get(name), dict) and "uri" in outputs[name]:
                    print(outputs[name]["uri"])


def products(path, folder):
    """Each product segmentor result: at least one person box, and both masks stored: the file
    fetched into FOLDER (named as the URI's last part) is a PNG of the shape the result gives,
    with its SHA-256 and size."""
    import hashlib
    import struct

    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not records:
        fail(f"{path}: no products result")
    for record in records:
        outputs = record.get("output", {}).get("outputs", {})
        boxes = outputs.get("people.p5", {}).get("boxes")
        if not boxes or any(b.get("label") != "person" for b in boxes):
            fail(f"{record.get('id')}: no person boxes: {json.dumps(record)[:400]}")
        for name in PRODUCT_MASKS:
            ref = outputs.get(name)
            if not isinstance(ref, dict) or not str(ref.get("uri", "")).startswith("s3://outputs/"):
                fail(f"{record.get('id')}: {name} is not stored in s3://outputs/: {json.dumps(record)[:400]}")
            data = (Path(folder) / ref["uri"].rsplit("/", 1)[-1]).read_bytes()
            if hashlib.sha256(data).hexdigest() != ref.get("sha256") or len(data) != ref.get("bytes"):
                fail(f"{record.get('id')}: {name} as stored is {len(data)} bytes, not the result's {ref}")
            if data[:8] != b"\x89PNG\r\n\x1a\n":
                fail(f"{record.get('id')}: {name} is not a PNG")
            width, height = struct.unpack(">II", data[16:24])
            if [height, width] != ref.get("shape"):
                fail(f"{record.get('id')}: {name} is {width}x{height}, the result says {ref.get('shape')}")
        say(f"{record.get('id')}: {len(boxes)} person box(es), both masks stored and read back "
            f"({outputs['foreground.mask']['shape']})")


def prometheus(url, jobs):
    def scraped():
        query = urllib.parse.urlencode({"query": "up"})
        _, body = get(f"{url}/api/v1/query?{query}")
        # A job's `up` is its least over its targets (the api-gateway job has two).
        up = {}
        for r in json.loads(body)["data"]["result"]:
            job = r["metric"].get("job")
            up[job] = min(up.get(job, "1"), r["value"][1])
        return all(up.get(job) == "1" for job in jobs) and up

    up = poll(f"Prometheus did not report up == 1 for {', '.join(jobs)}", 90, scraped)
    say(f"Prometheus scrapes {', '.join(f'{job} (up {up[job]})' for job in jobs)}")

    # The alerting rules: loaded from the mounted file, and each evaluated at least once without
    # an error (a query that fails only on live series, such as a many-to-many match, shows
    # here and nowhere else).
    def evaluated():
        _, body = get(f"{url}/api/v1/rules")
        rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
        failing = [f"{r['name']}: {r.get('lastError')}" for r in rules if r.get("health") == "err"]
        if failing:
            fail(f"Prometheus fails to evaluate rules: {'; '.join(failing)}")
        return rules and all(r.get("health") == "ok" for r in rules) and rules

    rules = poll("Prometheus did not load and evaluate the alerting rules", 60, evaluated)
    firing = [r["name"] for r in rules if r.get("state") == "firing"]
    say(f"Prometheus evaluates {len(rules)} alerting rules without error"
        f"{' (firing: ' + ', '.join(firing) + ')' if firing else ', none firing'}")


def metrics(root, urls):
    _, exprs = dashboard_exprs(root)
    wanted = sorted({name for expr in exprs for name in SELECTOR.findall(expr)})
    live = set()
    for url in urls:
        _, text = get(url)
        live |= {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    # A labelled family (counter, gauge or histogram with labels) appears in /metrics only once a
    # series exists: OOMs, rejections, retries and pauses have none in a run without them. Those
    # must at least be registered under that name by the service's metrics module.
    sources = {
        "vramgate_gateway_": (root / "api-gateway/src/metrics.rs").read_text(),
        "": (root / "ai-worker/src/metrics.rs").read_text(),
    }
    missing, declared = [], []
    for name in wanted:
        if name in live:
            continue
        prefix = "vramgate_gateway_" if name.startswith("vramgate_gateway_") else ""
        base = re.sub(r"_(bucket|sum|count)$", "", name[len(prefix):])
        if f'"{base}"' in sources[prefix] or f'"{prefix}{base}"' in sources[prefix]:
            declared.append(name)
        else:
            missing.append(name)
    if missing:
        fail(f"the dashboard queries metrics no service serves or registers: {', '.join(missing)}")
    say(f"{len(wanted) - len(declared)} of the dashboard's {len(wanted)} metrics are in the live /metrics; "
        f"registered, no series yet (no such event in this run): {', '.join(declared) or 'none'}")


def jaeger(url, service=None):
    def services():
        status, body = get(f"{url}/api/services")
        names = json.loads(body).get("data") or []
        return status == 200 and (service is None or service in names) and (names or ["(none yet)"])

    names = poll(f"Jaeger did not list {service or 'its services'}", 90, services)
    say(f"Jaeger answers; services: {', '.join(names)}")


# Time series columns a load run against the live stack must have filled (at least one row): a
# name the load generator scrapes that a service does not serve would leave its column empty.
LOAD_COLUMNS = ("worker_budget_bytes", "worker_used_bytes", "gateway_held_bytes", "consumer_lag")


def load(path, count, kind, folder):
    """A load run's summary: `count` events sent, every one back once (a result or a `kind`
    dead letter), nothing lost, the group settled; its CSV in `folder` has the services'
    series, its PNG is there."""
    summary = json.loads(Path(path).read_text())
    tasks = summary["tasks"]
    sent = sum(t["sent"] for t in tasks)
    if sent != count or summary["send_failures"]:
        fail(f"{path}: {sent} events sent and {summary['send_failures']} send failures, expected {count} and 0")
    for t in tasks:
        if t["lost"] != 0 or t["results"] + t["dead_letters"] != t["sent"]:
            fail(f"{path}: task {t['task']}: {t['sent']} sent, {t['results']} results, "
                 f"{t['dead_letters']} dead letters, {t['lost']} lost")
        if t["results"] == 0:
            fail(f"{path}: task {t['task']}: no results")
        other = set(t["dead_letters_by_kind"]) - {kind}
        if other:
            fail(f"{path}: task {t['task']}: dead letters of kinds {sorted(other)}, expected only {kind}")
    if not summary["settled"]:
        fail(f"{path}: the run did not settle (the gateway's group did not commit every request)")
    # The files are named as the container saw them (/reports/…); here they are in `folder`.
    folder = Path(folder)
    csv = (folder / Path(summary["csv"]).name).read_text().splitlines()
    header, rows = csv[0].split(","), [line.split(",") for line in csv[1:]]
    empty = [c for c in LOAD_COLUMNS if not any(r[header.index(c)] for r in rows)]
    if not rows or empty:
        fail(f"{folder}: {len(rows)} samples; columns never filled: {', '.join(empty)}")
    png = folder / Path(summary["png"] or "missing.png").name
    if not png.is_file() or png.read_bytes()[:4] != b"\x89PNG":
        fail(f"{png}: no PNG plot")
    per_task = ", ".join(
        f"{t['task']} {t['sent']} sent = {t['results']} results + {t['dead_letters']} dead letters "
        f"(p50 {t['latency_ms']['p50']} ms)" for t in tasks)
    say(f"{path}: {per_task}; 0 lost, {sum(t['duplicates'] for t in tasks)} duplicates, settled; "
        f"{len(rows)} samples in {folder / Path(summary['csv']).name}, plot {png}")


def main(argv):
    if len(argv) < 2:
        fail(__doc__)
    command, args = argv[1], argv[2:]
    if command == "static" and len(args) == 1:
        static(Path(args[0]))
    elif command == "outputs" and len(args) in (3, 4):
        outputs(args[0], int(args[1]), *args[2:])
    elif command == "prometheus" and len(args) >= 2:
        prometheus(args[0], args[1:])
    elif command == "metrics" and len(args) >= 2:
        metrics(Path(args[0]), args[1:])
    elif command == "jaeger" and len(args) in (1, 2):
        jaeger(*args)
    elif command == "products" and len(args) == 2:
        products(*args)
    elif command == "mask-uris" and len(args) == 1:
        mask_uris(args[0])
    elif command == "load" and len(args) == 4:
        load(args[0], int(args[1]), *args[2:])
    else:
        fail(f"bad arguments: {' '.join(argv[1:])}\n{__doc__}")


if __name__ == "__main__":
    main(sys.argv)
