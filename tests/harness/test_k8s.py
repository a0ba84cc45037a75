"""examples/k8s: the manifests parse and carry what a cluster needs, since no cluster runs here.

The validate Job (validate-job.yaml) is an Indexed Job of one pod per GPU node running
`nsa-validate oneshot` into a shared ReadWriteMany claim; the merge Job (merge-job.yaml) runs
`nsa-validate merge` on that claim. These tests check each manifest's structure, that the files
agree with each other (the claim, the mount path and round, N), and that their commands parse with
the real CLI.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from nsa_validate.paths import REPO_ROOT

K8S = REPO_ROOT / "examples" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
KNOWN_KINDS = {("batch/v1", "Job"), ("v1", "PersistentVolumeClaim"), ("v1", "Pod")}
GPU = "nvidia.com/gpu"
HOSTNAME = "kubernetes.io/hostname"
FLAGS = {"--json", "--strict", "--keep-going", "--share-gpu", "--one-at-a-time"}   # options without a value
VERDICT_EXITS = {1, 2, 3}          # FAIL, usage, environment broken: answers, never to be retried


# ---------------------------------------------------------------- loading

def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def documents() -> list[tuple[Path, dict]]:
    return [(p, d) for p in MANIFESTS for d in load(p)]


def only_job(name: str) -> dict:
    docs = [d for d in load(K8S / name) if d.get("kind") == "Job"]
    assert len(docs) == 1, f"{name}: expected one Job, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def validate() -> dict:
    return only_job("validate-job.yaml")


@pytest.fixture(scope="module")
def merge() -> dict:
    return only_job("merge-job.yaml")


def claims() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in documents() if d.get("kind") == "PersistentVolumeClaim"}


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"] if doc["kind"] == "Job" else doc["spec"]


def container(doc: dict) -> dict:
    cs = pod_spec(doc)["containers"]
    assert len(cs) == 1, f"{doc['metadata']['name']}: expected one container, found {len(cs)}"
    return cs[0]


def argv(c: dict) -> list[str]:
    return [*(c.get("command") or []), *(c.get("args") or [])]


def options(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """(option -> its values, positional arguments) of an argument list after the subcommand.
    Options take one value unless they are FLAGS; `--opt=value` works too."""
    opts: dict[str, list[str]] = {}
    positional: list[str] = []
    it = iter(args)
    for a in it:
        if a.startswith("-"):
            name, eq, val = a.partition("=")
            if eq:
                opts.setdefault(name, []).append(val)
            elif name in FLAGS:
                opts.setdefault(name, []).append("")
            else:
                opts.setdefault(name, []).append(next(it, None))
        else:
            positional.append(a)
    return opts, positional


def one(opts: dict[str, list[str]], name: str):
    vals = opts.get(name, [])
    assert len(vals) == 1, f"{name} given {len(vals)} times (want once): {opts}"
    return vals[0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env") or []}


def volume(doc: dict, name: str) -> dict:
    vols = {v["name"]: v for v in pod_spec(doc).get("volumes") or []}
    assert name in vols, f"{doc['metadata']['name']}: volumeMount '{name}' has no volume (volumes: {sorted(vols)})"
    return vols[name]


def runs_mount(doc: dict) -> dict:
    """The container's mount of a PersistentVolumeClaim (there must be exactly one)."""
    c = container(doc)
    mounts = [m for m in c.get("volumeMounts") or [] if "persistentVolumeClaim" in volume(doc, m["name"])]
    assert len(mounts) == 1, f"{doc['metadata']['name']}: expected one claim mounted, found {mounts}"
    return mounts[0]


def claim_of(doc: dict, mount: dict) -> str:
    return volume(doc, mount["name"])["persistentVolumeClaim"]["claimName"]


def gpu_count(c: dict, kind: str):
    return ((c.get("resources") or {}).get(kind) or {}).get(GPU)


def selects(selector: dict | None, labels: dict) -> bool:
    """Does a Kubernetes label selector (matchLabels, matchExpressions) select these labels?"""
    if not selector:
        return False          # null selects nothing; {} would select every pod, not only ours
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        ok = {"In": k in labels and labels[k] in vals, "NotIn": labels.get(k) not in vals,
              "Exists": k in labels, "DoesNotExist": k not in labels}[op]
        if not ok:
            return False
    return True


def cli_command(name: str):
    import typer
    from nsa_validate.cli import app
    group = typer.main.get_command(app)
    assert name in group.commands, f"nsa-validate has no '{name}' command: {sorted(group.commands)}"
    return group.commands[name]


# ---------------------------------------------------------------- every manifest

def test_the_example_files_are_there():
    names = {p.name for p in MANIFESTS}
    assert {"validate-job.yaml", "merge-job.yaml", "runs-pvc.yaml"} <= names, names
    assert (K8S / "README.md").is_file()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_parses_with_known_kinds(path):
    docs = load(path)
    assert docs, f"{path.name}: no document"
    for d in docs:
        assert isinstance(d, dict), f"{path.name}: a document is not a mapping"
        assert (d.get("apiVersion"), d.get("kind")) in KNOWN_KINDS, (d.get("apiVersion"), d.get("kind"))
        name = (d.get("metadata") or {}).get("name")
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name


def test_names_are_unique_per_kind():
    seen = [(d["kind"], d["metadata"]["name"]) for _, d in documents()]
    assert len(seen) == len(set(seen)), seen


def string_fields(d: dict):
    """(where, value) of every field the API types as a string that YAML might have made a number or bool."""
    yield from ((f"metadata.labels.{k}", v) for k, v in ((d.get("metadata") or {}).get("labels") or {}).items())
    if d["kind"] not in ("Job", "Pod"):
        return
    tmpl = d["spec"].get("template", {}) if d["kind"] == "Job" else {}
    yield from ((f"template.labels.{k}", v) for k, v in ((tmpl.get("metadata") or {}).get("labels") or {}).items())
    spec = pod_spec(d)
    yield from ((f"nodeSelector.{k}", v) for k, v in (spec.get("nodeSelector") or {}).items())
    for c in spec["containers"]:
        yield "container.name", c.get("name")
        yield "container.image", c.get("image")
        yield from ((f"{c.get('name')}.argv[{i}]", a) for i, a in enumerate(argv(c)))
        yield from ((f"{c.get('name')}.env.{e['name']}", e["value"]) for e in c.get("env") or [] if "value" in e)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_string_fields_are_strings(path):
    """`command: [..., 4]` or `nodeSelector: {x: true}` parse as YAML but the API server refuses them."""
    for d in load(path):
        for where, value in string_fields(d):
            assert isinstance(value, str) and value, f"{path.name}: {where} = {value!r} is not a non-empty string"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_mounted_volume_exists_and_every_claim_is_defined(path):
    defined = claims()
    for d in load(path):
        if d["kind"] not in ("Job", "Pod"):
            continue
        for c in pod_spec(d)["containers"]:
            for m in c.get("volumeMounts") or []:
                v = volume(d, m["name"])
                assert m["mountPath"].startswith("/"), m
                if "persistentVolumeClaim" in v:
                    assert v["persistentVolumeClaim"]["claimName"] in defined, \
                        f"{path.name}: claim {v['persistentVolumeClaim']['claimName']!r} is defined by no manifest here"


def test_runs_claim_is_read_write_many(validate):
    pvc = claims()[claim_of(validate, runs_mount(validate))]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "pods on several nodes write to it at once"
    assert pvc["spec"]["resources"]["requests"]["storage"]


# ---------------------------------------------------------------- the validate Job

def test_validate_job_is_an_indexed_job_of_one_completion_per_node(validate):
    assert (validate["apiVersion"], validate["kind"]) == ("batch/v1", "Job")
    s = validate["spec"]
    assert s.get("completionMode") == "Indexed"
    assert isinstance(s.get("completions"), int) and s["completions"] >= 1
    assert s.get("parallelism") == s["completions"], "every node validated at once: parallelism == completions"


def test_validate_job_puts_one_pod_per_node(validate):
    """A required anti-affinity (or a hard spread of skew 1) by hostname, selecting this Job's pods."""
    labels = validate["spec"]["template"]["metadata"]["labels"]
    spec = pod_spec(validate)
    terms = (((spec.get("affinity") or {}).get("podAntiAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or [])
    spread = [t for t in spec.get("topologySpreadConstraints") or []
              if t.get("maxSkew") == 1 and t.get("whenUnsatisfiable") == "DoNotSchedule"]
    rules = [t for t in terms + spread if t.get("topologyKey") == HOSTNAME]
    assert rules, f"no required anti-affinity or DoNotSchedule spread keyed on {HOSTNAME}"
    assert any(selects(t.get("labelSelector"), labels) for t in rules), \
        f"no such rule's labelSelector selects the pod template's labels {labels}"


def test_validate_job_runs_on_gpu_nodes_with_all_their_gpus(validate):
    c = container(validate)
    limit = gpu_count(c, "limits")
    assert isinstance(limit, int) and limit > 0, f"resources.limits.{GPU} = {limit!r}"
    request = gpu_count(c, "requests")
    assert request is None or request == limit, f"{GPU} requests {request} != limits {limit}"
    spec = pod_spec(validate)
    assert any(t.get("key") == GPU or (t.get("operator") == "Exists" and "key" not in t)
               for t in spec.get("tolerations") or []), f"no toleration of the {GPU} taint GPU nodes often carry"
    selector = spec.get("nodeSelector") or {}
    assert any(k.startswith("nvidia.com/") for k in selector) or "nodeAffinity" in (spec.get("affinity") or {}), \
        "GPU nodes are not selected"


def test_validate_job_image_is_set(validate):
    image = container(validate).get("image")
    assert isinstance(image, str) and image.strip() and not re.search(r"\s", image), image


def test_validate_job_command(validate):
    """`nsa-validate oneshot --gpus all --out <the claim's mount> --node $(NODE_NAME)`, NODE_NAME
    being the node's name (spec.nodeName) from the downward API."""
    c = container(validate)
    args = argv(c)
    assert args[:2] == ["nsa-validate", "oneshot"], args
    opts, positional = options(args[2:])
    assert not positional, f"oneshot takes no arguments: {positional}"
    assert one(opts, "--gpus") == "all"
    assert one(opts, "--out") == runs_mount(validate)["mountPath"], "the run folders must land on the shared volume"
    assert one(opts, "--node") == "$(NODE_NAME)"
    node = env_of(c).get("NODE_NAME")
    assert node and node.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName", node


@pytest.mark.parametrize("job", ["validate-job.yaml", "merge-job.yaml"])
def test_every_variable_in_the_command_is_defined(job):
    """The kubelet expands $(VAR) from the container's env; an undefined one stays literal."""
    d = only_job(job)
    c = container(d)
    defined = set(env_of(c)) | ({"JOB_COMPLETION_INDEX"} if d["spec"].get("completionMode") == "Indexed" else set())
    used = {v for a in argv(c) for v in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(a))}
    assert used <= defined, f"undefined: {used - defined}"


def test_validate_job_never_retries_a_verdict(validate):
    """A FAIL (exit 1), a usage error (2) or a broken environment (3) ends that node's index without
    a retry that could turn it into a pass; other nodes' runs are not stopped by it."""
    s = validate["spec"]
    assert pod_spec(validate)["restartPolicy"] == "Never"
    policy = s.get("podFailurePolicy")
    if policy is None:              # without a policy only "no retry at all" is safe
        assert s.get("backoffLimit") == 0 and "backoffLimitPerIndex" not in s
        return
    rules = policy["rules"]
    names = {c["name"] for c in pod_spec(validate)["containers"]}
    for r in rules:
        assert ("onExitCodes" in r) != ("onPodConditions" in r), f"a rule needs exactly one of them: {r}"
        assert r["action"] in {"FailJob", "FailIndex", "Ignore", "Count"}, r
        if "onExitCodes" in r:
            e = r["onExitCodes"]
            assert e.get("containerName", next(iter(names))) in names, f"containerName not a container: {e}"
            assert e["values"] == sorted(set(e["values"])), "the API wants the values sorted and unique"
            assert e["operator"] in ("In", "NotIn") and (e["operator"] == "NotIn" or 0 not in e["values"])

    def matches(r, code):
        e = r.get("onExitCodes")
        return e is not None and (code in e["values"]) == (e["operator"] == "In")

    for code in sorted(VERDICT_EXITS):
        first = next((r for r in rules if matches(r, code) or "onPodConditions" in r), None)
        assert first is not None and first["action"] in ("FailIndex", "FailJob"), \
            f"exit {code}: the first rule that can match is {first}, not FailIndex/FailJob"
    fail_index = any(r["action"] == "FailIndex" for r in rules)
    if fail_index:
        assert isinstance(s.get("backoffLimitPerIndex"), int), "FailIndex needs backoffLimitPerIndex"
    if "backoffLimitPerIndex" in s:
        assert 0 <= s["backoffLimitPerIndex"] <= 2, "a small number of retries, for disruptions only"
        worst = s["completions"] * (s["backoffLimitPerIndex"] + 1)
        assert s.get("backoffLimit", 2**31 - 1) >= worst, \
            f"backoffLimit {s.get('backoffLimit')} < {worst}: it could fail the Job and stop healthy nodes' runs"
    else:
        assert 0 <= s.get("backoffLimit", 6) <= 3, "backoffLimit must be small"


def test_validate_job_is_bounded_in_time(validate):
    deadline = validate["spec"].get("activeDeadlineSeconds")
    assert isinstance(deadline, int) and 600 <= deadline <= 24 * 3600, deadline


def test_validate_job_has_a_memory_backed_dev_shm(validate):
    mounts = {m["mountPath"]: m for m in container(validate).get("volumeMounts") or []}
    assert "/dev/shm" in mounts, "torch and NCCL need more than the 64 MiB default /dev/shm"
    assert volume(validate, mounts["/dev/shm"]["name"]).get("emptyDir", {}).get("medium") == "Memory"


# ---------------------------------------------------------------- the merge Job

def test_merge_job_is_a_single_pod_job_without_gpu(merge):
    assert (merge["apiVersion"], merge["kind"]) == ("batch/v1", "Job")
    s = merge["spec"]
    assert s.get("completions", 1) == 1 and s.get("parallelism", 1) == 1
    assert s.get("completionMode", "NonIndexed") == "NonIndexed"
    assert pod_spec(merge)["restartPolicy"] == "Never"
    for c in pod_spec(merge)["containers"]:
        assert gpu_count(c, "limits") is None and gpu_count(c, "requests") is None, f"{c['name']} asks for a GPU"
    image = container(merge).get("image")
    assert isinstance(image, str) and image.strip() and not re.search(r"\s", image), image


def test_merge_job_merges_the_validate_jobs_runs(validate, merge):
    """`nsa-validate merge <the shared mount> --expect-count <completions> --out <on the volume>`, on
    the claim, path and round the validate Job wrote to."""
    mv, mm = runs_mount(validate), runs_mount(merge)
    assert claim_of(merge, mm) == claim_of(validate, mv)
    assert (mm["mountPath"], mm.get("subPath"), mm.get("subPathExpr")) == \
        (mv["mountPath"], mv.get("subPath"), mv.get("subPathExpr")), "the same folder of the volume"
    args = argv(container(merge))
    assert args[:2] == ["nsa-validate", "merge"], args
    opts, paths = options(args[2:])
    root = mm["mountPath"].rstrip("/")
    assert paths and all(p.rstrip("/") == root or p.startswith(root + "/") for p in paths), \
        f"merge paths {paths} are not on the volume mounted at {root}"
    assert root in {p.rstrip("/") for p in paths}, "the merge must read the whole shared root the pods wrote into"
    assert int(one(opts, "--expect-count")) == validate["spec"]["completions"]
    out = one(opts, "--out").rstrip("/")
    assert out == root or out.startswith(root + "/"), "the fleet report must land on the volume"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_mount_of_the_runs_claim_is_the_same_folder(path, validate):
    """The reader (and any other pod on the claim) sees the paths the Jobs saw."""
    mv = runs_mount(validate)
    for d in load(path):
        if d["kind"] in ("Job", "Pod"):
            for c in pod_spec(d)["containers"]:
                for m in c.get("volumeMounts") or []:
                    v = volume(d, m["name"]).get("persistentVolumeClaim")
                    if v and v["claimName"] == claim_of(validate, mv):
                        assert (m["mountPath"], m.get("subPath")) == (mv["mountPath"], mv.get("subPath")), \
                            f"{d['metadata']['name']} mounts the claim as {m}"


# ---------------------------------------------------------------- the commands against the real CLI

COMMANDS = {"validate-job.yaml": "oneshot", "merge-job.yaml": "merge"}


@pytest.mark.parametrize("job", sorted(COMMANDS), ids=lambda j: f"{j}:{COMMANDS[j]}")
def test_command_options_are_in_the_cli_help(job):
    """Each option the manifest passes is one the command documents in its --help."""
    from typer.testing import CliRunner
    from nsa_validate.cli import app
    sub = COMMANDS[job]
    args = argv(container(only_job(job)))
    assert args[:2] == ["nsa-validate", sub]
    used = {a.partition("=")[0] for a in args[2:] if a.startswith("-")}
    known = {o for p in cli_command(sub).params for o in (*p.opts, *p.secondary_opts)}
    r = CliRunner().invoke(app, [sub, "--help"], env={"NO_COLOR": "1", "COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert r.exit_code == 0, r.output
    for o in sorted(used):
        assert o in known, f"`nsa-validate {sub}` has no option {o} (it has {sorted(known)})"
        assert re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", r.output), f"{o} not in `{sub} --help`"


@pytest.mark.parametrize("job", sorted(COMMANDS), ids=lambda j: f"{j}:{COMMANDS[j]}")
def test_command_parses_with_the_cli(job, tmp_path):
    """The whole argument list parses as the CLI's command (types, choices, values), the kubelet's
    $(VAR) replaced by a value and the volume's mount path by an existing folder."""
    d = only_job(job)
    mount = runs_mount(d)["mountPath"].rstrip("/")
    args = argv(container(d))[2:]
    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", "gpu-node-0", a) for a in args]
    args = [str(tmp_path) + a[len(mount):] if a == mount or a.startswith(mount + "/") else a for a in args]
    cmd = cli_command(COMMANDS[job])
    try:
        ctx = cmd.make_context(COMMANDS[job], list(args))
    except Exception as e:       # click's UsageError / BadParameter: say which command line
        pytest.fail(f"`nsa-validate {COMMANDS[job]} {shlex.join(args)}` does not parse: {e}")
    ctx.close()
