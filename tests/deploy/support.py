"""What the deployment checks share: the settings the code reads, the metric names it exports,
helm, and a small model of how `docker build` lays files out in an image.

Everything is read from the code at test time, so a setting, metric or script added later is
picked up without touching these tests.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "axon"
DASHBOARDS = CHART / "dashboards"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKER_DIR = ROOT / "infra" / "docker"
MIGRATIONS = ROOT / "shared" / "migrations" / "sql"

# Kubernetes release the rendered manifests are validated against (EKS 1.31; kubernetes-validate
# carries its schemas offline).
KUBERNETES_VERSION = "1.31.0"

AXON_NAME = re.compile(r"\bAXON_[A-Z0-9_]*[A-Z0-9]\b")


# --- settings ------------------------------------------------------------------------------------


def settings_classes() -> list[type]:
    """Every pydantic-settings class of shared/settings.py and services/*/settings.py."""
    from pydantic_settings import BaseSettings

    modules = ["shared.settings"] + [
        f"services.{path.parent.name}.settings" for path in sorted((ROOT / "services").glob("*/settings.py"))
    ]
    found: list[type] = []
    for name in modules:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseSettings) and obj is not BaseSettings and obj not in found:
                found.append(obj)
    return found


def settings_env_names() -> dict[str, list[str]]:
    """Environment variable -> the settings classes that read it (env prefix + field name, and aliases)."""
    names: dict[str, list[str]] = {}
    for cls in settings_classes():
        prefix = cls.model_config.get("env_prefix", "") or ""
        for field_name, info in cls.model_fields.items():
            candidates = {f"{prefix}{field_name}".upper()}
            for alias in (info.alias, info.validation_alias):
                if isinstance(alias, str):
                    candidates.add(alias.upper())
            for env in candidates:
                names.setdefault(env, []).append(cls.__name__)
    return names


def setting_default(cls_name: str, field_name: str) -> Any:
    for cls in settings_classes():
        if cls.__name__ == cls_name:
            return cls.model_fields[field_name].default
    raise LookupError(f"no settings class {cls_name}")


def console_scripts() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["scripts"])


def axon_names_in_text(text: str) -> set[str]:
    return set(AXON_NAME.findall(text))


# --- metrics -------------------------------------------------------------------------------------

_METRIC_DEFINITION = re.compile(r"\b(Counter|Gauge|Histogram|Summary)\(\s*\"(axon_[a-z0-9_]+)\"", re.S)
_METRIC_USE = re.compile(r"\baxon_[a-z0-9_]+\b")


def exported_metric_names() -> set[str]:
    """Series names the code exports (with the suffixes Prometheus adds), read from its sources."""
    names: set[str] = set()
    for path in list((ROOT / "services").rglob("*.py")) + list((ROOT / "shared").rglob("*.py")):
        for kind, name in _METRIC_DEFINITION.findall(path.read_text()):
            base = name.removesuffix("_total")
            if kind == "Counter":
                names |= {f"{base}_total", f"{base}_created"}
            elif kind in ("Histogram", "Summary"):
                names |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
            else:
                names.add(name)
    return names


def metric_names_in_promql(expr: str) -> set[str]:
    return set(_METRIC_USE.findall(expr))


# --- helm ----------------------------------------------------------------------------------------


def helm_binary() -> str:
    """helm from the venv (infra/scripts/install-helm.sh) or PATH; skip, or fail under CI, if absent."""
    candidates = [Path(sys.executable).parent / "helm", ROOT / ".venv" / "bin" / "helm"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("helm")
    if found:
        return found
    reason = "helm is not installed: run `bash infra/scripts/install-helm.sh .venv/bin` (make test does)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the chart checks")
    pytest.skip(reason)


def helm(*args: str, tmp_home: Path) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_home),
        "HELM_CACHE_HOME": str(tmp_home / "cache"),
        "HELM_CONFIG_HOME": str(tmp_home / "config"),
        "HELM_DATA_HOME": str(tmp_home / "data"),
    }
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, timeout=60, check=False)


REQUIRED_SECRETS = {
    "secrets.redisUrl.name": "axon-redis",
    "secrets.amqpUrl.name": "axon-rabbitmq",
    "secrets.databaseUrl.name": "axon-postgres",
    "secrets.adminToken.name": "axon-admin",
    "secrets.internalToken.name": "axon-internal",
}


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set-string", f"{key}={value}")]


def load_manifests(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


# --- rendered manifests ------------------------------------------------------------------------------


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def named(manifests: list[dict], kind: str, name: str) -> dict:
    found = [m for m in of_kind(manifests, kind) if m["metadata"]["name"] == name]
    assert len(found) == 1, (
        f"expected one {kind} {name}, got {[m['metadata']['name'] for m in of_kind(manifests, kind)]}"
    )
    return found[0]


def assert_counts_the_models_queues(trigger: dict, namespace: str, model: str, *, batch: bool) -> None:
    """A KEDA rabbitmq trigger sums, through the management API, the model's shared queue (`batch`:
    its batch queue) and its tenants' queues of that band, and no other queue."""
    from shared.names import Names

    metadata = trigger["metadata"]
    assert (metadata["protocol"], metadata["useRegex"], metadata["operation"]) == ("http", "true", "sum")
    pattern = re.compile(metadata["queueName"])
    names = Names(namespace)
    shared = names.batch_queue(model) if batch else names.jobs_queue(model)
    counted = [shared, names.tenant_queue(model, "acme", batch=batch), names.tenant_queue(model, "a b/c", batch=batch)]
    others = [
        names.jobs_queue(model) if batch else names.batch_queue(model),
        names.tenant_queue(model, "acme", batch=not batch),
        names.worker_queue(model, "worker-1"),
        names.dead_letter_queue,
        # A model whose name starts with this one's, one that differs where this one has a dot
        # (the name is matched literally), and the same model in another namespace.
        names.jobs_queue(f"{model}-awq"),
        names.tenant_queue(f"{model}-awq", "acme", batch=batch),
        names.jobs_queue(model.replace(".", "x")),
        Names(f"{namespace}x").jobs_queue(model),
    ]
    assert [q for q in counted if not pattern.search(q)] == [], metadata["queueName"]
    assert [q for q in others if pattern.search(q)] == [], metadata["queueName"]


def component(manifests: list[dict], kind: str, name: str) -> list[dict]:
    return [m for m in of_kind(manifests, kind) if m["metadata"]["labels"].get("app.kubernetes.io/component") == name]


def workloads(manifests: list[dict]) -> list[dict]:
    return of_kind(manifests, "Deployment") + of_kind(manifests, "Job")


# Components the chart runs from other projects' images (tracing.collector): not Axon processes.
THIRD_PARTY_COMPONENTS = {"otel-collector"}


def axon_workloads(manifests: list[dict]) -> list[dict]:
    """Workloads that run Axon's own processes (its console scripts, its probes)."""
    return [
        w
        for w in workloads(manifests)
        if w["metadata"]["labels"].get("app.kubernetes.io/component") not in THIRD_PARTY_COMPONENTS
    ]


def env_of(container: dict) -> dict[str, object]:
    """name -> literal value, or ("secret", name, key), or ("field", path)."""
    out: dict[str, object] = {}
    for item in container.get("env", []):
        assert item["name"] not in out, f"{item['name']} is set twice in {container['name']}"
        if "value" in item:
            out[item["name"]] = item["value"]
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            out[item["name"]] = ("secret", ref["name"], ref["key"])
        else:
            out[item["name"]] = ("field", item["valueFrom"]["fieldRef"]["fieldPath"])
    return out


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# --- docker build, modelled --------------------------------------------------------------------------


def _dockerignore_regex(pattern: str) -> re.Pattern:
    pattern = str(PurePosixPath(pattern.strip().lstrip("/")))
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


@dataclass
class DockerIgnore:
    rules: list[tuple[bool, re.Pattern]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> DockerIgnore:
        rules = []
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            rules.append((negated, _dockerignore_regex(line.lstrip("!"))))
        return cls(rules)

    def excluded(self, rel_path: str) -> bool:
        """Docker's rule: the last pattern matching the path or one of its parent directories wins."""
        parts = rel_path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        excluded = False
        for negated, regex in self.rules:
            if any(regex.match(prefix) for prefix in prefixes):
                excluded = not negated
        return excluded


def context_files(ignore: DockerIgnore) -> list[str]:
    """Files `docker build .` would send from the repository root, as relative POSIX paths."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames[:] = [d for d in dirnames if d not in (".git", ".venv", "node_modules")]
        for name in filenames:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not ignore.excluded(rel):
                out.append(rel)
    return sorted(out)


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages). Continuation lines are joined; comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name=name, base=words[0], instructions=[]))
        elif not stages and keyword == "ARG":
            key, _, default = rest.partition("=")
            global_args[key.strip()] = default.strip()
        elif stages:
            stages[-1].instructions.append((keyword, rest.strip()))
    return global_args, stages


def _copy_args(rest: str) -> tuple[dict[str, str], list[str]]:
    if rest.startswith("["):
        import json

        words = json.loads(rest)
    else:
        words = shlex.split(rest)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


def image_files(dockerfile: Path, target: str | None = None) -> dict[str, str]:
    """The files of the build context that end up in the image: {path in image: path in repo}.

    Follows FROM <stage>, WORKDIR and COPY (from the context or --from another stage) and applies
    .dockerignore. RUN steps are not modelled: they add no files from the repository.
    """
    ignore = DockerIgnore.load(ROOT / ".dockerignore")
    files = context_files(ignore)
    _, stages = parse_dockerfile(dockerfile)
    fs: dict[str, dict[str, str]] = {}
    for stage in stages:
        image = dict(fs.get(stage.base, {}))
        workdir = "/"
        for keyword, rest in stage.instructions:
            if keyword == "WORKDIR":
                workdir = str(PurePosixPath(workdir, rest))
            elif keyword in ("COPY", "ADD"):
                flags, words = _copy_args(rest)
                *sources, dest = words
                dest_dir = dest.endswith("/") or len(sources) > 1
                dest = str(PurePosixPath(workdir, dest))
                for source in sources:
                    if "from" in flags:
                        origin = fs[flags["from"]]
                        src = str(PurePosixPath("/", source))
                        picked = {p: r for p, r in origin.items() if p == src or p.startswith(src.rstrip("/") + "/")}
                        for path, repo_path in picked.items():
                            tail = (
                                PurePosixPath(path).relative_to(src)
                                if path != src
                                else PurePosixPath(PurePosixPath(src).name)
                            )
                            if path == src and not dest_dir:
                                image[dest] = repo_path
                            else:
                                image[str(PurePosixPath(dest, tail))] = repo_path
                        continue
                    src = PurePosixPath(source).as_posix()
                    src = "" if src == "." else src
                    for rel in files:
                        if src and rel == src:
                            target_path = str(PurePosixPath(dest, PurePosixPath(rel).name)) if dest_dir else dest
                            image[target_path] = rel
                        elif not src or rel.startswith(src.rstrip("/") + "/"):
                            tail = rel[len(src.rstrip("/")) + 1 :] if src else rel
                            image[str(PurePosixPath(dest, tail))] = rel
        fs[stage.name] = image
    final = target or stages[-1].name
    return fs[final]


def stage_instructions(dockerfile: Path, target: str) -> list[tuple[str, str]]:
    """Instructions that apply to `target`, its base stages' first."""
    _, stages = parse_dockerfile(dockerfile)
    by_name = {s.name: s for s in stages}
    chain = []
    stage = by_name[target]
    while True:
        chain.append(stage)
        if stage.base not in by_name:
            break
        stage = by_name[stage.base]
    return [ins for s in reversed(chain) for ins in s.instructions]


def matches_any(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) for p in patterns)
