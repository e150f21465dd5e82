"""The chart README's laptop-cluster recipe installs a pod a default minikube can schedule."""

from __future__ import annotations

import shlex
from typing import Any

from helm_chart_helpers import CHART, render

# A default `minikube start`: 2 CPUs and 2200 MB up to 6000 MB of memory (by the host's);
# the control plane requests 750m CPU (apiserver 250m, controller-manager 200m, etcd 100m,
# scheduler 100m, coredns 100m) and 170Mi (etcd 100Mi, coredns 70Mi).
NODE_CPU_M, NODE_MEMORY_MI = 2000 - 750, 2200 * 1000 * 1000 // 2**20 - 170


def laptop_install() -> list[str]:
    readme = (CHART / "README.md").read_text()
    section = readme.split("## Try it on a laptop cluster", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    command = block.replace("\\\n", " ").splitlines()[0]
    args = shlex.split(command)
    assert args[:3] == ["helm", "install", "lp"], args
    return args


def set_values(args: list[str]) -> dict[str, Any]:
    """The values of the command's --set flags, typed as Helm types them (bools, integers)."""
    values: dict[str, Any] = {}
    for flag, arg in zip(args, args[1:]):
        if flag != "--set":
            continue
        key, text = arg.split("=", 1)
        value: Any = {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)
        *parents, leaf = key.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return values


def cpu_m(q: str) -> int:
    return int(q[:-1]) if q.endswith("m") else int(float(q) * 1000)


def memory_mi(q: str) -> int:
    units = {"Mi": 1, "Gi": 1024}
    return int(float(q[:-2]) * units[q[-2:]])


def test_laptop_recipe_fits_a_default_minikube() -> None:
    r = render(set_values(laptop_install()))
    pod = r.pod
    assert not pod["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu")
    # what the scheduler counts: the containers and native sidecars together (no other init containers here)
    running = pod["containers"] + [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    assert len(running) == len(pod["containers"]) + len(pod.get("initContainers", []))
    cpu = sum(cpu_m(str(c["resources"]["requests"]["cpu"])) for c in running)
    memory = sum(memory_mi(c["resources"]["requests"]["memory"]) for c in running)
    assert cpu <= NODE_CPU_M and memory <= NODE_MEMORY_MI, (cpu, memory)
