#!/usr/bin/python3
"""Offline checks of the deployment manifests (deploy/k8s, deploy/systemd, deploy/Dockerfile).

Every YAML document and unit file is parsed, and the fields a broken deployment would get wrong are
checked against each other and against the real binaries: probe types and ports against container
ports and the --port flags, GPU limits, grace periods against --drain_seconds, labels against
selectors, the headless Service, the pod entry command (run with a stand-in binary to see the rank
and address it computes), every flag against the binary's --helpfull, and the systemd ExecStart
paths against the launchers inside the runtime bundle. `systemd-analyze verify` also runs where
systemd is installed.

Run by bazel (sh_test) with Debian's /usr/bin/python3 and python3-yaml.
"""

import glob
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import unittest

import yaml

RUNFILES = os.path.join(os.environ["TEST_SRCDIR"], "moe_serve")
DEPLOY = os.path.join(RUNFILES, "deploy")
BINARIES = {
    "moe-coordinator": os.path.join(RUNFILES, "server/coordinator/moe_coordinator"),
    "moe-shard": os.path.join(RUNFILES, "server/shard/moe_shard"),
}
BUNDLE_PREFIX = "/opt/moe-serve/bin/"
COORDINATOR_SHUTDOWN_GRACE_S = 5  # moe_coordinator_main.cc: kShutdownGrace


def binary_flags(launcher):
    """The flag names a binary accepts, from its --helpfull listing."""
    out = subprocess.run([BINARIES[launcher], "--helpfull"], capture_output=True, text=True,
                         timeout=30)
    flags = set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", out.stdout + out.stderr, re.M))
    assert "port" in flags, "no flags parsed from %s --helpfull" % launcher
    return flags


def flag_values(argv):
    """{name: value} of the --name=value arguments in argv."""
    values = {}
    for arg in argv:
        m = re.fullmatch(r"--([A-Za-z0-9_]+)=(.*)", arg)
        assert m, "argument %r is not --flag=value" % arg
        values[m.group(1)] = m.group(2)
    return values


def run_with_stand_in(script, env):
    """Runs a shell entry whose `exec /opt/moe-serve/bin/X ARGS` is redirected to a stand-in that
    prints its arguments; returns (X, ARGS)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in BINARIES:
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                f.write('#!/bin/sh\necho "$(basename "$0")"\nfor a in "$@"; do echo "$a"; done\n')
            os.chmod(path, 0o755)
        assert BUNDLE_PREFIX in script, script
        out = subprocess.run(["/bin/sh", "-c", script.replace(BUNDLE_PREFIX, tmp + "/")],
                             env=dict(env, PATH="/usr/bin:/bin"), capture_output=True, text=True,
                             timeout=30, check=True)
    lines = out.stdout.splitlines()
    return lines[0], lines[1:]


def bundle_launchers():
    """Names under bin/ of the runtime bundle that //deploy:bundle builds."""
    with tarfile.open(os.path.join(DEPLOY, "moe-serve-bundle.tar.gz")) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name]
    return {n[len("bin/"):] for n in names if n.startswith("bin/") and n != "bin/"}


def version():
    with open(os.path.join(DEPLOY, "VERSION")) as f:
        return f.read().strip()


class KubernetesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.docs = []
        for path in sorted(glob.glob(os.path.join(DEPLOY, "k8s", "*.yaml"))):
            with open(path) as f:
                for doc in yaml.safe_load_all(f):
                    if doc is not None:
                        cls.docs.append((os.path.basename(path), doc))
        cls.by_kind_name = {(d["kind"], d["metadata"]["name"]): d for _, d in cls.docs
                            if "metadata" in d}
        cls.coordinator = cls.get("Deployment", "moe-coordinator")
        cls.coordinator_service = cls.get("Service", "moe-coordinator")
        cls.shards = cls.get("StatefulSet", "moe-shard")
        cls.shard_service = cls.get("Service", cls.shards["spec"]["serviceName"])

    @classmethod
    def get(cls, kind, name):
        doc = cls.by_kind_name.get((kind, name))
        assert doc is not None, "no %s %s in deploy/k8s (have %s)" % (kind, name,
                                                                       sorted(cls.by_kind_name))
        return doc

    @staticmethod
    def container(workload):
        containers = workload["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1, "one container per pod"
        return containers[0]

    @staticmethod
    def port_number(container, port):
        """A probe or targetPort value (number or port name) as a container port number."""
        by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
        if isinstance(port, str):
            assert port in by_name, "port name %s not in %s" % (port, by_name)
            return by_name[port]
        assert port in by_name.values(), "port %s not exposed: %s" % (port, by_name)
        return port

    def shard_argv(self, pod_name="moe-shard-3", pod_ip="10.1.2.3"):
        c = self.container(self.shards)
        self.assertEqual(c["command"], ["/bin/sh", "-c"])
        self.assertEqual(len(c["args"]), 1)
        binary, argv = run_with_stand_in(c["args"][0], {"HOSTNAME": pod_name, "POD_IP": pod_ip})
        self.assertEqual(binary, "moe-shard")
        return argv

    def check_metrics(self, workload, flags):
        """The metrics port is exposed, served on every interface and where the annotations say."""
        c = self.container(workload)
        self.assertEqual(self.port_number(c, "metrics"), int(flags["metrics_port"]))
        self.assertEqual(flags["http_host"], "0.0.0.0")
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/scrape"], "true")
        self.assertEqual(int(annotations["prometheus.io/port"]), int(flags["metrics_port"]))

    def test_documents_are_complete(self):
        kinds = sorted(d["kind"] for _, d in self.docs)
        self.assertEqual(kinds, ["Deployment", "Kustomization", "PersistentVolumeClaim", "Service",
                                 "Service", "StatefulSet"])
        for path, doc in self.docs:
            self.assertIn("apiVersion", doc, path)
            if doc["kind"] != "Kustomization":
                self.assertIn("name", doc["metadata"], path)
        kustomization = next(d for _, d in self.docs if d["kind"] == "Kustomization")
        files = {p for p, d in self.docs if d["kind"] != "Kustomization"}
        self.assertEqual(sorted(kustomization["resources"]), sorted(files))

    def test_selectors_match_pod_labels(self):
        for workload in (self.coordinator, self.shards):
            selector = workload["spec"]["selector"]["matchLabels"]
            labels = workload["spec"]["template"]["metadata"]["labels"]
            self.assertLessEqual(selector.items(), labels.items(), workload["metadata"]["name"])
        for service, workload, other in ((self.coordinator_service, self.coordinator, self.shards),
                                         (self.shard_service, self.shards, self.coordinator)):
            selector = service["spec"]["selector"]
            self.assertLessEqual(selector.items(),
                                 workload["spec"]["template"]["metadata"]["labels"].items())
            self.assertFalse(selector.items() <= other["spec"]["template"]["metadata"]
                             ["labels"].items(), "service %s selects both workloads"
                             % service["metadata"]["name"])
            for port in service["spec"]["ports"]:
                self.port_number(self.container(workload), port["targetPort"])

    def test_coordinator(self):
        spec = self.coordinator["spec"]
        self.assertEqual(spec["replicas"], 1)
        self.assertEqual(spec["strategy"]["type"], "Recreate")
        c = self.container(self.coordinator)
        self.assertEqual(c["command"], [BUNDLE_PREFIX + "moe-coordinator"])
        flags = flag_values(c["args"])
        self.assertLessEqual(flags.keys(), binary_flags("moe-coordinator"))
        port = int(flags["port"])
        self.assertEqual(flags["host"], "0.0.0.0")
        self.assertEqual(self.port_number(c, "grpc"), port)
        self.assertEqual(c["readinessProbe"]["grpc"]["port"], port)
        self.assertEqual(self.port_number(c, c["livenessProbe"]["grpc"]["port"]), port)
        self.assertGreater(int(flags["max_connection_age_seconds"]), 0)
        self.assertGreater(spec["template"]["spec"]["terminationGracePeriodSeconds"],
                           COORDINATOR_SHUTDOWN_GRACE_S)
        self.check_metrics(self.coordinator, flags)
        self.assertEqual(self.port_number(c, "dashboard"), int(flags["dashboard_port"]))

    def test_shard_statefulset(self):
        spec = self.shards["spec"]
        pod = spec["template"]["spec"]
        c = self.container(self.shards)
        flags = flag_values(self.shard_argv())
        self.assertLessEqual(flags.keys(), binary_flags("moe-shard"))
        # One pod per GPU.
        self.assertEqual(str(c["resources"]["limits"]["nvidia.com/gpu"]), "1")
        self.assertEqual(str(c["resources"].get("requests", {}).get("nvidia.com/gpu", 1)), "1")
        self.assertEqual(flags["backend"], "cuda")
        # Parallel start: the first map needs every shard registered.
        self.assertEqual(spec["podManagementPolicy"], "Parallel")
        coordinator_flags = flag_values(self.container(self.coordinator)["args"])
        self.assertEqual(spec["replicas"], int(coordinator_flags["num_shards"]))
        # Probes on the port the shard listens on.
        port = int(flags["port"])
        self.assertEqual(self.port_number(c, "grpc"), port)
        self.assertEqual(c["readinessProbe"]["grpc"]["port"], port)
        liveness = c["livenessProbe"]
        probe = liveness.get("tcpSocket") or liveness.get("grpc")
        self.assertIsNotNone(probe, "liveness must be a TCP or gRPC probe")
        self.assertEqual(self.port_number(c, probe["port"]), port)
        # Draining fits in the grace period.
        self.assertGreater(pod["terminationGracePeriodSeconds"], int(flags["drain_seconds"]))
        self.assertGreater(int(flags["max_connection_age_seconds"]), 0)
        # The coordinator is dialled through its Service.
        service = self.coordinator_service
        self.assertEqual(flags["coordinator"], "%s:%d" % (service["metadata"]["name"],
                                                           service["spec"]["ports"][0]["port"]))
        # The model directory is a read-only volume that the pod declares.
        mounts = [m for m in c["volumeMounts"] if flags["model"].startswith(m["mountPath"])]
        self.assertEqual(len(mounts), 1, "--model=%s is on no volume" % flags["model"])
        self.assertTrue(mounts[0]["readOnly"])
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
        self.assertTrue("persistentVolumeClaim" in volume or "hostPath" in volume)
        if "persistentVolumeClaim" in volume:
            self.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        self.check_metrics(self.shards, flags)
        # POD_IP comes from the downward API.
        env = {e["name"]: e for e in c["env"]}
        self.assertEqual(env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP")

    def test_headless_service(self):
        self.assertEqual(self.shard_service["spec"]["clusterIP"], "None")
        self.assertEqual(self.shards["spec"]["serviceName"], self.shard_service["metadata"]["name"])

    def test_entry_command_takes_rank_from_the_pod_ordinal(self):
        for pod, rank in (("moe-shard-0", "0"), ("moe-shard-7", "7"), ("moe-shard-12", "12")):
            flags = flag_values(self.shard_argv(pod, "10.9.8.7"))
            self.assertEqual(flags["rank"], rank, pod)
            self.assertEqual(flags["host"], "10.9.8.7")

    def test_image_holds_the_bundle_where_the_manifests_look(self):
        image = "moe-serve:" + version()
        for workload in (self.coordinator, self.shards):
            self.assertEqual(self.container(workload)["image"], image)
        with open(os.path.join(DEPLOY, "Dockerfile")) as f:
            dockerfile = f.read()
        self.assertRegex(dockerfile, r"(?m)^ADD moe-serve-\$\{VERSION\}\.tar\.gz /opt/$")
        self.assertRegex(dockerfile, r"(?m)^RUN ln -s /opt/moe-serve-\$\{VERSION\} /opt/moe-serve$")
        self.assertLessEqual({"moe-coordinator", "moe-shard"}, bundle_launchers())


def parse_unit(path):
    """{section: [(key, value), ...]} of a systemd unit file (keys may repeat)."""
    sections, current = {}, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r"\[(\w+)\]", line)
            if m:
                current = sections.setdefault(m.group(1), [])
                continue
            key, sep, value = line.partition("=")
            assert current is not None and sep, "%s: bad line %r" % (path, line)
            current.append((key.strip(), value.strip()))
    return sections


def unit_value(unit, section, key):
    values = [v for k, v in unit[section] if k == key]
    assert len(values) == 1, "%s %s: %s" % (section, key, values)
    return values[0]


def read_env_file(path):
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                env[key] = value
    return env


def systemd_expand(command, env, instance):
    """ExecStart as systemd hands it over: %i replaced, $$ -> $, ${VAR} from the environment."""
    command = command.replace("%i", instance)

    def substitute(m):
        if m.group(0) == "$$":
            return "$"
        assert m.group(1) in env, "ExecStart uses ${%s}, not in the environment file" % m.group(1)
        return env[m.group(1)]
    return shlex.split(re.sub(r"\$\$|\$\{(\w+)\}", substitute, command))


class SystemdTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        d = os.path.join(DEPLOY, "systemd")
        cls.coordinator = parse_unit(os.path.join(d, "moe-coordinator.service"))
        cls.shard = parse_unit(os.path.join(d, "moe-shard@.service"))
        cls.env = read_env_file(os.path.join(d, "moe-serve.env.example"))

    def test_common_fields(self):
        for unit in (self.coordinator, self.shard):
            self.assertEqual(sorted(unit), ["Install", "Service", "Unit"])
            self.assertIn(unit_value(unit, "Service", "Restart"), ("always", "on-failure"))
            self.assertEqual(unit_value(unit, "Service", "EnvironmentFile"),
                             "/etc/moe-serve/moe-serve.env")
            self.assertEqual(unit_value(unit, "Service", "KillSignal"), "SIGTERM")
            self.assertEqual(unit_value(unit, "Install", "WantedBy"), "multi-user.target")
            self.assertIn("network-online.target", unit_value(unit, "Unit", "After"))

    def test_coordinator_exec_start(self):
        argv = systemd_expand(unit_value(self.coordinator, "Service", "ExecStart"), self.env, "")
        self.assertEqual(argv[0], BUNDLE_PREFIX + "moe-coordinator")
        flags = flag_values(argv[1:])
        self.assertLessEqual(flags.keys(), binary_flags("moe-coordinator"))
        self.assertEqual(flags["num_shards"], self.env["MOE_NUM_SHARDS"])
        self.assertGreater(int(unit_value(self.coordinator, "Service", "TimeoutStopSec")),
                           COORDINATOR_SHUTDOWN_GRACE_S)

    def test_shard_instance_is_the_gpu(self):
        self.assertIn(("Environment", "CUDA_VISIBLE_DEVICES=%i"), self.shard["Service"])
        argv = systemd_expand(unit_value(self.shard, "Service", "ExecStart"), self.env, "2")
        self.assertEqual(argv[:2], ["/bin/sh", "-c"])
        env = dict(self.env, MOE_RANK_BASE="8")  # the second host of 8 GPUs each
        binary, args = run_with_stand_in(argv[2], env)
        self.assertEqual(binary, "moe-shard")
        flags = flag_values(args)
        self.assertLessEqual(flags.keys(), binary_flags("moe-shard"))
        self.assertEqual(flags["rank"], "10")
        self.assertEqual(int(flags["port"]), int(self.env["MOE_SHARD_BASE_PORT"]) + 2)
        self.assertEqual(int(flags["metrics_port"]), int(self.env["MOE_METRICS_BASE_PORT"]) + 2)
        self.assertEqual(flags["model"], self.env["MOE_MODEL"])
        self.assertEqual(flags["coordinator"], self.env["MOE_COORDINATOR"])
        self.assertGreater(int(unit_value(self.shard, "Service", "TimeoutStopSec")),
                           int(flags["drain_seconds"]))

    def test_ports_of_one_host_do_not_collide(self):
        # The coordinator may share a host with up to 8 shards.
        coordinator = [int(self.env[k]) for k in ("MOE_COORDINATOR_PORT",
                                                  "MOE_COORDINATOR_METRICS_PORT",
                                                  "MOE_DASHBOARD_PORT")]
        shards = [int(self.env[k]) + i for k in ("MOE_SHARD_BASE_PORT", "MOE_METRICS_BASE_PORT")
                  for i in range(8)]
        ports = coordinator + shards
        self.assertEqual(len(ports), len(set(ports)), sorted(ports))

    def test_exec_start_paths_are_bundle_launchers(self):
        launchers = bundle_launchers()
        for unit in (self.coordinator, self.shard):
            command = unit_value(unit, "Service", "ExecStart")
            paths = re.findall(re.escape(BUNDLE_PREFIX) + r"([\w.-]+)", command)
            self.assertEqual(len(paths), 1, command)
            self.assertIn(paths[0], launchers)

    @unittest.skipUnless(shutil.which("systemd-analyze"), "systemd-analyze is not installed")
    def test_systemd_analyze_verify(self):
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "opt/moe-serve/bin"))
            for name in BINARIES:  # verify checks that ExecStart programs are executable
                path = os.path.join(root, "opt/moe-serve/bin", name)
                with open(path, "w") as f:
                    f.write("#!/bin/sh\n")
                os.chmod(path, 0o755)
            os.makedirs(os.path.join(root, "bin"))
            shutil.copy("/bin/sh", os.path.join(root, "bin/sh"))
            os.makedirs(os.path.join(root, "etc/moe-serve"))
            shutil.copy(os.path.join(DEPLOY, "systemd/moe-serve.env.example"),
                        os.path.join(root, "etc/moe-serve/moe-serve.env"))
            shutil.copytree("/usr/lib/systemd/system", os.path.join(root, "usr/lib/systemd/system"),
                            symlinks=True)
            units = os.path.join(root, "etc/systemd/system")
            os.makedirs(units)
            for name in ("moe-coordinator.service", "moe-shard@.service"):
                shutil.copy(os.path.join(DEPLOY, "systemd", name), units)
            out = subprocess.run(["systemd-analyze", "verify", "--root=" + root, "--man=no",
                                  "--generators=no", "moe-coordinator.service",
                                  "moe-shard@0.service"],
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout + out.stderr, "", "systemd-analyze verify complained")


class HelpTest(unittest.TestCase):
    """`--help` (not only --helpfull) lists each server binary's own flags and the shared
    security flags, with their defaults: what an operator reads first."""

    def test_help_lists_the_binary_flags(self):
        for launcher, own in (("moe-shard", ("model", "backend", "cuda_device", "coordinator")),
                              ("moe-coordinator", ("num_shards", "redundant_slots", "port"))):
            out = subprocess.run([BINARIES[launcher], "--help"], capture_output=True, text=True,
                                 timeout=30)
            text = out.stdout + out.stderr
            listed = set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", text, re.M))
            for flag in own + ("tls_cert", "auth_tokens_file"):
                self.assertIn(flag, listed, "%s --help does not list --%s" % (launcher, flag))
            self.assertNotIn("No flags matched", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
