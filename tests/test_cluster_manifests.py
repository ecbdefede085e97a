"""examples/cluster/: the manifests users start from, held against the tools that run them.

Every manifest trains the same config into the same work_dir. The Kubernetes ones are read
key by key against the models of the ``kubernetes`` client (pod and job templates, containers,
env, resources, volumes) and, for the custom resources' own parts, against field lists taken
from the operators' Go types (PyTorchJob, JobSet) or the Kubeflow Trainer SDK's models
(TrainJob); the clients ignore a key they do not know, so the check is our own, recursive. The
Slurm script passes ``bash -n``, its ``#SBATCH`` lines are read into the environment an srun
task would see, which stratagem's Slurm reading must take as one run; the SkyPilot task is
read against the fields of SkyPilot's YAML reference. The shell of the Slurm script and of the
SkyPilot ``run`` runs for real, with ``srun``/``python`` replaced by functions that print the
command, and every command is parsed by ``stratagem train``'s own parser.
"""

from __future__ import annotations

import os
import re
import subprocess
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes.client
import pytest
import yaml
from kubeflow_trainer_api import models as trainer_models

from launcher_env import is_launcher_variable
from stratagem.cli import build_sub_parser

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / 'examples' / 'cluster'
CONFIG = 'examples/configs/classifier.py'
WORK_DIR = '/shared/classifier'
IMAGE_ROOT = '/workspace'  # where the manifests' image holds this repository
K8S = ('pytorchjob.yaml', 'pytorchjob-torchrun.yaml', 'trainjob.yaml', 'jobset.yaml')

# What each operator sets in a pod (or task) for the rendezvous, by name. Sources:
# training-operator pkg/controller.v1/pytorch/envvar.go and master.go (PyTorchJob; PET_* with
# nprocPerNode), kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go (TrainJob),
# Kubernetes' Indexed Job (JOB_COMPLETION_INDEX), SkyPilot's "Distributed Multi-Node Jobs"
# page, Slurm's srun(1) OUTPUT ENVIRONMENT VARIABLES.
OPERATOR_SETS = {
    'pytorchjob.yaml': {'RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'},
    'pytorchjob-torchrun.yaml': {
        'PET_NNODES', 'PET_NPROC_PER_NODE', 'PET_NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT',
    },
    'trainjob.yaml': {
        'PET_NNODES', 'PET_NPROC_PER_NODE', 'PET_NODE_RANK', 'PET_MASTER_ADDR', 'PET_MASTER_PORT',
    },
    'jobset.yaml': {'JOB_COMPLETION_INDEX'},
    'skypilot.yaml': {
        'SKYPILOT_NODE_RANK', 'SKYPILOT_NODE_IPS', 'SKYPILOT_NUM_NODES',
        'SKYPILOT_NUM_GPUS_PER_NODE',
    },
    'slurm.sbatch': {
        'SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_STEP_NUM_TASKS', 'SLURM_STEP_NODELIST',
        'SLURM_JOB_ID', 'SLURM_STEP_ID', 'SLURM_RESTART_COUNT',
    },
}  # fmt: skip
# The variables stratagem's launch code (env/launcher.py, env/cluster.py, env/slurm.py, cli/)
# reads. PENDING: a name listed before the code reads it (none now); the test below holds
# the rest to the code.
LAUNCHER_READS = {
    'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT',
    'SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_STEP_NUM_TASKS', 'SLURM_STEP_NODELIST',
    'SLURM_JOB_ID', 'SLURM_STEP_ID', 'SLURM_RESTART_COUNT',
    'PET_NNODES', 'PET_NPROC_PER_NODE', 'PET_NODE_RANK', 'PET_MASTER_ADDR', 'PET_MASTER_PORT',
    'JOB_COMPLETION_INDEX',
    'SKYPILOT_NODE_RANK', 'SKYPILOT_NODE_IPS', 'SKYPILOT_NUM_NODES', 'SKYPILOT_NUM_GPUS_PER_NODE',
}  # fmt: skip
PENDING: set[str] = set()


# -- a strict reader: every key of a document must be a field of the type it is read as --


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class MapOf:
    value: Any
    keys: frozenset[str] | None = None  # None: any string


@dataclass(frozen=True)
class OneOf:
    values: frozenset[Any]


_API = kubernetes.client.ApiClient()
# the client's type names: ``List[V1EnvVar]`` / ``Dict[str, str]`` (kubernetes >= 37) or
# ``list[V1EnvVar]`` / ``dict[str, str]`` (earlier releases)
_K8S_TYPE = re.compile(r'^(List|Dict|list|dict)\[(?:str, )?(.*)\]$')
_LEAVES = {'str': str, 'int': int, 'bool': bool, 'float': (int, float), 'object': object}


def unknown_keys(value: Any, schema: Any, where: str = '') -> list[str]:
    """Every key of ``value`` that ``schema`` has no field for, and every value of the wrong
    kind, as ``'path: problem'`` lines. ``schema``: a dict of fields (a Go struct), a
    ``kubernetes.client`` model or type name (``'V1PodTemplateSpec'``, ``'List[V1EnvVar]'``),
    a pydantic model class, ``ListOf``/``MapOf``/``OneOf``, or a Python type."""
    if isinstance(schema, str):
        return _k8s_keys(value, schema, where)
    if isinstance(schema, type) and hasattr(schema, 'model_fields'):
        return _pydantic_keys(value, schema, where)
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f'{where}: expected a mapping, got {value!r}']
        out = [
            f'{where}.{k}: unknown field; known: {sorted(schema)}' for k in value if k not in schema
        ]
        for k, v in value.items():
            if k in schema:
                out += unknown_keys(v, schema[k], f'{where}.{k}')
        return out
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return [f'{where}: expected a list, got {value!r}']
        return [
            e for i, v in enumerate(value) for e in unknown_keys(v, schema.item, f'{where}[{i}]')
        ]
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            return [f'{where}: expected a mapping, got {value!r}']
        out = []
        for k, v in value.items():
            if schema.keys is not None and k not in schema.keys:
                out.append(f'{where}.{k}: not one of {sorted(schema.keys)}')
            out += unknown_keys(v, schema.value, f'{where}.{k}')
        return out
    if isinstance(schema, OneOf):
        return (
            []
            if value in schema.values
            else [f'{where}: {value!r} not one of {sorted(schema.values)}']
        )
    if schema is object or (
        isinstance(value, schema) and not (schema is int and isinstance(value, bool))
    ):
        return []
    return [f'{where}: expected {schema}, got {value!r}']


def _k8s_keys(value: Any, name: str, where: str) -> list[str]:
    match = _K8S_TYPE.match(name)
    if match:
        kind, inner = match.groups()
        return unknown_keys(value, (ListOf if kind.lower() == 'list' else MapOf)(inner), where)
    if name in _LEAVES:
        return unknown_keys(value, _LEAVES[name], where)
    model = getattr(kubernetes.client, name)
    if not isinstance(value, dict):
        return [f'{where}: expected a mapping ({name}), got {value!r}']
    fields = {json_key: model.openapi_types[attr] for attr, json_key in model.attribute_map.items()}
    return unknown_keys(value, fields, where)


def _pydantic_keys(value: Any, model: type, where: str) -> list[str]:
    fields = {f.alias or n: _annotation_schema(f.annotation) for n, f in model.model_fields.items()}
    return unknown_keys(value, fields, where)


def _annotation_schema(annotation: Any) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _annotation_schema(args[0])
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return _annotation_schema(kept[0]) if len(kept) == 1 else object
    if origin is list:
        return ListOf(_annotation_schema(args[0]))
    if origin is dict:
        return MapOf(_annotation_schema(args[1]))
    if isinstance(annotation, type) and 'actual_instance' in getattr(
        annotation, 'model_fields', {}
    ):
        return object  # the SDK's oneOf of scalars (a quantity: string or number)
    if isinstance(annotation, type) and (
        hasattr(annotation, 'model_fields') or annotation in (str, int, bool)
    ):
        return annotation
    return object  # datetime, Any, IntOrString: not ours to read


def k8s_value_errors(value: Any, name: str) -> str | None:
    """The client's own reading of ``value`` as model ``name`` (types, required fields)."""
    try:
        _API._ApiClient__deserialize(value, name)
    except (ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError
        return f'{name}: {err}'
    return None


# -- the custom resources' own parts, from their Go types --

# kubeflow/training-operator pkg/apis/kubeflow.org/v1/common_types.go (ReplicaSpec, RunPolicy,
# SchedulingPolicy; suspend and managedBy from v1.8) and pytorch_types.go (PyTorchJobSpec,
# ElasticPolicy)
RUN_POLICY = {
    'cleanPodPolicy': OneOf(frozenset({'All', 'Running', 'None'})),
    'ttlSecondsAfterFinished': int,
    'activeDeadlineSeconds': int,
    'backoffLimit': int,
    'schedulingPolicy': {
        'minAvailable': int, 'queue': str, 'minResources': MapOf(str),
        'priorityClass': str, 'scheduleTimeoutSeconds': int,
    },
    'suspend': bool,
    'managedBy': str,
}  # fmt: skip
REPLICA_SPEC = {
    'replicas': int,
    'template': 'V1PodTemplateSpec',
    'restartPolicy': OneOf(frozenset({'Always', 'OnFailure', 'Never', 'ExitCode'})),
}
PYTORCHJOB = {
    'apiVersion': OneOf(frozenset({'kubeflow.org/v1'})),
    'kind': OneOf(frozenset({'PyTorchJob'})),
    'metadata': 'V1ObjectMeta',
    'spec': {
        'runPolicy': RUN_POLICY,
        'elasticPolicy': {
            'minReplicas': int, 'maxReplicas': int, 'rdzvBackend': str, 'rdzvPort': int,
            'rdzvHost': str, 'rdzvId': str, 'rdzvConf': ListOf({'key': str, 'value': str}),
            'standalone': bool, 'nProcPerNode': int, 'maxRestarts': int, 'metrics': ListOf(object),
        },
        'pytorchReplicaSpecs': MapOf(REPLICA_SPEC, frozenset({'Master', 'Worker'})),
        'nprocPerNode': str,
    },
}  # fmt: skip
# kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go (JobSetSpec, ReplicatedJob,
# Network, SuccessPolicy, FailurePolicy, StartupPolicy, Coordinator, VolumeClaimPolicy)
JOBSET = {
    'apiVersion': OneOf(frozenset({'jobset.x-k8s.io/v1alpha2'})),
    'kind': OneOf(frozenset({'JobSet'})),
    'metadata': 'V1ObjectMeta',
    'spec': {
        'replicatedJobs': ListOf({
            'name': str, 'groupName': str, 'template': 'V1JobTemplateSpec', 'replicas': int,
            'dependsOn': ListOf({'name': str, 'status': OneOf(frozenset({'Ready', 'Complete'}))}),
        }),
        'network': {'enableDNSHostnames': bool, 'subdomain': str, 'publishNotReadyAddresses': bool},
        'successPolicy': {
            'operator': OneOf(frozenset({'All', 'Any'})), 'targetReplicatedJobs': ListOf(str),
        },
        'failurePolicy': {
            'maxRestarts': int,
            'restartStrategy': OneOf(frozenset({'Recreate', 'BlockingRecreate', 'InPlaceRestart'})),
            'rules': ListOf({
                'name': str, 'action': str, 'onJobFailureReasons': ListOf(str),
                'onJobFailureMessagePatterns': ListOf(str), 'targetReplicatedJobs': ListOf(str),
            }),
        },
        'startupPolicy': {'startupPolicyOrder': OneOf(frozenset({'AnyOrder', 'InOrder'}))},
        'suspend': bool,
        'coordinator': {'replicatedJob': str, 'jobIndex': int, 'podIndex': int},
        'managedBy': str,
        'ttlSecondsAfterFinished': int,
        'volumeClaimPolicies': ListOf({
            'templates': ListOf('V1PersistentVolumeClaim'),
            'retentionPolicy': {'whenDeleted': OneOf(frozenset({'Delete', 'Retain'}))},
        }),
    },
}  # fmt: skip
# SkyPilot's task YAML, https://docs.skypilot.co/en/latest/reference/yaml-spec.html (the
# skypilot package itself pulls a web server and a database: too heavy for a test extra)
SKY_RESOURCES = dict.fromkeys(
    [
        'infra',
        'cloud',
        'region',
        'zone',
        'accelerators',
        'accelerator_args',
        'cpus',
        'memory',
        'instance_type',
        'use_spot',
        'disk_size',
        'disk_tier',
        'network_tier',
        'max_hourly_cost',
        'image_id',
        'ports',
        'labels',
        'autostop',
        'any_of',
        'ordered',
        'job_recovery',
    ],
    object,
)
SKYPILOT = {
    'name': str, 'workdir': object, 'num_nodes': int, 'resources': SKY_RESOURCES,
    'envs': MapOf(object), 'secrets': MapOf(object), 'volumes': MapOf(str),
    'file_mounts': MapOf(object), 'setup': str, 'run': str, 'config': dict, 'service': dict,
}  # fmt: skip


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def pod_templates(name: str, doc: dict) -> list[dict]:
    """The pod templates (``V1PodTemplateSpec``) of a Kubernetes manifest."""
    if doc.get('kind') == 'PyTorchJob':
        return [r['template'] for r in doc['spec']['pytorchReplicaSpecs'].values()]
    if doc.get('kind') == 'JobSet':
        return [r['template']['spec']['template'] for r in doc['spec']['replicatedJobs']]
    return []


def train_args(argv: list[str]):
    """``python -m stratagem train ...`` parsed by the command's own parser (the options the
    command line gives; None where it gives none)."""
    assert argv[:4] == ['python', '-m', 'stratagem', 'train'], argv
    return build_sub_parser('train').parse_args(argv[4:])


def launched(argv: list[str], operator_env: dict[str, str]):
    """The launch options ``stratagem train`` runs with in a container where the operator
    set ``operator_env`` (and no other launcher variable): the command's own filled in by
    ``launch_from_environment``, which refuses a flag contradicting a variable."""
    from stratagem.cli.launch import launch_from_environment

    args = train_args(argv)
    kept = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    with mock.patch.dict(os.environ, {**kept, **operator_env}, clear=True):
        launch_from_environment(args)
    return args


def expand_k8s(words: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of command and args."""
    return [re.sub(r'\$\(([A-Za-z_][A-Za-z0-9_]*)\)', lambda m: env[m.group(1)], w) for w in words]


def k8s_commands(name: str, sample_env: dict[str, str]) -> list[tuple[list[str], dict, dict]]:
    """(argv as the container runs it, container, resources) of every trainer container."""
    doc = load(name)
    if doc['kind'] == 'TrainJob':
        t = doc['spec']['trainer']
        return [
            (expand_k8s(t['command'] + t.get('args', []), sample_env), t, t['resourcesPerNode'])
        ]
    out = []
    for template in pod_templates(name, doc):
        for c in template['spec']['containers']:
            own = {e['name']: e.get('value', '') for e in c.get('env', [])}
            argv = expand_k8s(c['command'] + c.get('args', []), {**sample_env, **own})
            out.append((argv, c, c['resources']))
    return out


def referenced_vars(words: list[str]) -> set[str]:
    return {m for w in words for m in re.findall(r'\$\(([A-Za-z_][A-Za-z0-9_]*)\)', w)}


FAKE_LAUNCHERS = 'srun() { "$@"; }\npython() { printf \'%s\\0\' "$@"; }\n'


def run_shell(script: str, env: dict[str, str]) -> list[list[str]]:
    """Run ``script`` with ``srun`` and ``python`` as functions printing the command: every
    python command it would start, as argv (``python`` first)."""
    body = re.sub(
        r'^set -euo pipefail$', lambda m: m.group(0) + '\n' + FAKE_LAUNCHERS, script, flags=re.M
    )
    if FAKE_LAUNCHERS not in body:
        body = 'set -euo pipefail\n' + FAKE_LAUNCHERS + body
    out = subprocess.run(
        ['bash', '-c', body], env={'PATH': '/usr/bin:/bin', **env},
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    words = out.stdout.split('\0')[:-1]
    return [['python', *words]] if words else []


# -- the tests --


def test_checker_reports_unknown_keys_and_wrong_values():
    """The reader can fail: a misspelt container key, a CRD field that does not exist, a
    number where Kubernetes wants a quantity string, a bad enum."""
    pod = {
        'spec': {
            'containers': [
                {'name': 'a', 'image': 'i', 'evn': [], 'resources': {'limits': {'cpu': 2}}}
            ]
        }
    }
    errors = unknown_keys(pod, 'V1PodTemplateSpec')
    assert any(e.startswith('.spec.containers[0].evn: unknown field') for e in errors), errors
    assert any(
        ".spec.containers[0].resources.limits.cpu: expected <class 'str'>" in e for e in errors
    )
    if int(kubernetes.__version__.split('.')[0]) >= 37:  # its pydantic models check values
        assert k8s_value_errors(pod, 'V1PodTemplateSpec') is not None  # it refuses 2 too
    job = load('jobset.yaml')
    job['spec']['replicatedJob'] = job['spec'].pop('replicatedJobs')
    assert unknown_keys(job, JOBSET)[0].startswith('.spec.replicatedJob: unknown field')
    torch_job = load('pytorchjob.yaml')
    torch_job['spec']['pytorchReplicaSpecs']['Chief'] = torch_job['spec']['pytorchReplicaSpecs'][
        'Worker'
    ]
    torch_job['spec']['runPolicy']['cleanPodPolicy'] = 'Never'
    assert set(unknown_keys(torch_job, PYTORCHJOB)) == {
        ".spec.runPolicy.cleanPodPolicy: 'Never' not one of ['All', 'None', 'Running']",
        ".spec.pytorchReplicaSpecs.Chief: not one of ['Master', 'Worker']",
    }
    train = load('trainjob.yaml')
    train['spec']['trainer']['numProcsPerNode'] = 2
    assert unknown_keys(train, trainer_models.TrainerV1alpha1TrainJob) == [
        ".spec.trainer.numProcsPerNode: unknown field; known: ['args', 'command', 'env', "
        "'image', 'numNodes', 'numProcPerNode', 'resourcesPerNode']"
    ]


@pytest.mark.parametrize(
    ('name', 'schema'),
    [
        ('pytorchjob.yaml', PYTORCHJOB),
        ('pytorchjob-torchrun.yaml', PYTORCHJOB),
        ('jobset.yaml', JOBSET),
        ('trainjob.yaml', trainer_models.TrainerV1alpha1TrainJob),
        ('shared-pvc.yaml', 'V1PersistentVolumeClaim'),
        ('skypilot.yaml', SKYPILOT),
    ],
)
def test_manifest_has_only_known_fields(name, schema):
    doc = load(name)
    assert unknown_keys(doc, schema) == []
    if name == 'trainjob.yaml':  # the SDK's own reading: required fields, strict types
        trainer_models.TrainerV1alpha1TrainJob.from_dict(doc)
    elif name == 'shared-pvc.yaml':
        assert k8s_value_errors(doc, 'V1PersistentVolumeClaim') is None
    for template in pod_templates(name, doc):
        assert k8s_value_errors(template, 'V1PodTemplateSpec') is None
    if name == 'jobset.yaml':
        for rjob in doc['spec']['replicatedJobs']:
            assert k8s_value_errors(rjob['template'], 'V1JobTemplateSpec') is None


def _gpus(resources: dict) -> int:
    return int(resources['limits']['nvidia.com/gpu'])


def test_pytorchjob_one_process_per_pod():
    doc = load('pytorchjob.yaml')
    specs = doc['spec']['pytorchReplicaSpecs']
    assert specs['Master']['replicas'] == 1 and sum(s['replicas'] for s in specs.values()) == 2
    pod = dict(RANK='1', WORLD_SIZE='2', MASTER_ADDR='stratagem-classifier-master-0')
    for argv, container, resources in k8s_commands('pytorchjob.yaml', {}):
        given = train_args(argv)
        assert given.nproc is None and given.nnodes is None  # no flag: the pod is one rank
        args = launched(argv, {**pod, 'MASTER_PORT': '23456'})
        assert args.nproc == 1 and args.nnodes == '1' and _gpus(resources) == 1
        # the operator reads MASTER_PORT from the port of this name on the container 'pytorch'
        assert container['name'] == 'pytorch'
        assert [p['name'] for p in container['ports']] == ['pytorchjob-port']
    assert 'nprocPerNode' not in doc['spec']  # else RANK would count pods, not processes


def test_pytorchjob_torchrun_nproc_matches_the_operator():
    doc = load('pytorchjob-torchrun.yaml')
    pet = dict(
        PET_NNODES='2',
        PET_NPROC_PER_NODE=doc['spec']['nprocPerNode'],
        PET_NODE_RANK='1',
        PET_MASTER_ADDR='stratagem-classifier-master-0',
        PET_MASTER_PORT='23456',
    )
    for argv, container, resources in k8s_commands('pytorchjob-torchrun.yaml', {}):
        given = train_args(argv)
        assert str(given.nproc) == doc['spec']['nprocPerNode'] == str(_gpus(resources)) == '2'
        # the rendezvous is the operator's (PET_*): flags would only repeat it
        assert given.nnodes is None and given.master_addr is None
        args = launched(argv, pet)  # PET_* become torchrun's options; --nproc agrees
        assert (args.nnodes, args.node_rank, args.nproc) == ('2', 1, 2)
        assert (args.master_addr, str(args.master_port)) == (pet['PET_MASTER_ADDR'], '23456')
        assert container['name'] == 'pytorch'


def test_trainjob_uses_the_torch_runtime_and_leaves_pet_to_it():
    doc = load('trainjob.yaml')
    spec = doc['spec']
    assert spec['runtimeRef']['name'] == 'torch-distributed'
    ((argv, trainer, resources),) = k8s_commands('trainjob.yaml', {})
    args = train_args(argv)
    assert args.nproc == trainer['numProcPerNode'] == _gpus(resources) == 2
    assert trainer['numNodes'] == 2
    # the Torch plugin refuses a TrainJob that sets torchrun's variables itself
    assert not [e for e in trainer.get('env', []) if e['name'].startswith('PET_')]
    (patch,) = spec['runtimePatches']
    (rjob,) = patch['trainingRuntimeSpec']['template']['spec']['replicatedJobs']
    pod = rjob['template']['spec']['template']['spec']
    assert rjob['name'] == 'node' and [c['name'] for c in pod['containers']] == ['node']
    assert [m['mountPath'] for m in pod['containers'][0]['volumeMounts']] == ['/shared']


def test_jobset_rendezvous_names_pod_zero_and_the_completion_index():
    doc = load('jobset.yaml')
    (rjob,) = doc['spec']['replicatedJobs']
    job = rjob['template']['spec']
    assert doc['spec']['network']['enableDNSHostnames'] is True
    assert job['completionMode'] == 'Indexed' and job['parallelism'] == job['completions']
    subdomain = doc['spec']['network'].get('subdomain', doc['metadata']['name'])
    pod0 = f'{doc["metadata"]["name"]}-{rjob["name"]}-0-0.{subdomain}'
    for rank in (0, 1):
        ((argv, container, resources),) = k8s_commands(
            'jobset.yaml', {'JOB_COMPLETION_INDEX': str(rank)}
        )
        args = train_args(argv)
        assert args.node_rank == rank
        assert int(args.nnodes) == job['parallelism'] * rjob['replicas'] == 2
        assert args.master_addr == pod0 and args.nproc == _gpus(resources) == 2
        assert args.master_port in [p['containerPort'] for p in container['ports']]


def _sbatch_options(text: str) -> dict[str, str]:
    options = {}
    for line in text.splitlines():
        if line.startswith('#SBATCH'):
            for word in line.split()[1:]:
                key, eq, value = word.partition('=')
                assert key.startswith('--') and (value or not eq), f'#SBATCH {word!r}: --key=value'
                options[key[2:]] = value if eq else 'set'
    return options


def test_slurm_script_parses_and_srun_tasks_are_one_run(monkeypatch):
    path = CLUSTER / 'slurm.sbatch'
    subprocess.run(['bash', '-n', str(path)], check=True, timeout=30)
    text = path.read_text()
    opts = _sbatch_options(text)
    nodes, per_node = int(opts['nodes']), int(opts['ntasks-per-node'])
    assert (nodes, per_node) == (2, 2) and int(opts['gpus-per-node']) == per_node
    assert (opts['signal'], opts['requeue']) == ('USR1@120', 'set')
    commands = run_shell(text, {'SLURM_JOB_ID': '4242', 'SLURM_JOB_NODELIST': 'gpu[07-08]'})
    (argv,) = commands
    args = train_args(argv)
    assert args.nproc is None  # srun starts every rank: one task per GPU
    assert args.cfg_options == ['train_cfg.preemption=dict(signals=["SIGUSR1"],requeue=True)']
    # the environment srun gives the last task of this allocation, read by stratagem
    from stratagem.env import infer_launcher, slurm

    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'):
        monkeypatch.delenv(key, raising=False)
    task = {
        'SLURM_JOB_ID': '4242', 'SLURM_STEP_ID': '0', 'SLURM_PROCID': str(nodes * per_node - 1),
        'SLURM_LOCALID': str(per_node - 1), 'SLURM_NODEID': str(nodes - 1),
        'SLURM_NTASKS': str(nodes * per_node), 'SLURM_STEP_NUM_TASKS': str(nodes * per_node),
        'SLURM_STEP_NUM_NODES': str(nodes), 'SLURM_STEP_NODELIST': 'gpu[07-08]',
        'SLURM_STEP_TASKS_PER_NODE': f'{per_node}(x{nodes})',
    }  # fmt: skip
    for key, value in task.items():
        monkeypatch.setenv(key, value)
    assert infer_launcher() == 'slurm'
    assert slurm.step_ntasks() == 4 and slurm.num_nodes() == 2 and slurm.local_size(4) == 2
    assert slurm.expand_slurm_nodelist(task['SLURM_STEP_NODELIST'])[0] == 'gpu07'


def test_skypilot_run_turns_its_variables_into_the_rendezvous():
    doc = load('skypilot.yaml')
    gpus = int(doc['resources']['accelerators'].split(':')[1])
    for rank in (0, 1):
        env = {
            'SKYPILOT_NODE_RANK': str(rank), 'SKYPILOT_NODE_IPS': '10.0.0.5\n10.0.0.6\n',
            'SKYPILOT_NUM_NODES': str(doc['num_nodes']), 'SKYPILOT_NUM_GPUS_PER_NODE': str(gpus),
        }  # fmt: skip
        (argv,) = run_shell(doc['run'], env)
        args = train_args(argv)
        assert (args.node_rank, args.nnodes, args.nproc) == (rank, '2', gpus)
        assert args.master_addr == '10.0.0.5'  # the head node, first of SKYPILOT_NODE_IPS
    assert WORK_DIR.startswith(next(iter(doc['volumes'])))


def _all_commands() -> dict[str, list[list[str]]]:
    commands = {
        name: [argv for argv, _, _ in k8s_commands(name, {'JOB_COMPLETION_INDEX': '0'})]
        for name in K8S
    }
    sky = load('skypilot.yaml')
    commands['skypilot.yaml'] = run_shell(
        sky['run'],
        {'SKYPILOT_NODE_RANK': '0', 'SKYPILOT_NODE_IPS': 'h0\nh1', 'SKYPILOT_NUM_NODES': '2',
         'SKYPILOT_NUM_GPUS_PER_NODE': '2'},
    )  # fmt: skip
    commands['slurm.sbatch'] = run_shell(
        (CLUSTER / 'slurm.sbatch').read_text(), {'SLURM_JOB_ID': '1', 'SLURM_JOB_NODELIST': 'n1'}
    )
    return commands


def test_every_manifest_trains_the_same_config_into_the_same_work_dir():
    commands = _all_commands()
    assert set(commands) == {p.name for p in CLUSTER.iterdir()} - {'shared-pvc.yaml'}
    for name, argvs in commands.items():
        assert argvs, f'{name}: no stratagem train command'
        for argv in argvs:
            args = train_args(argv)
            config = args.config.removeprefix(IMAGE_ROOT + '/')
            assert config == CONFIG, f'{name}: trains {args.config}, not {CONFIG}'
            assert (args.work_dir, args.resume) == (WORK_DIR, 'auto'), name
    assert (ROOT / CONFIG).is_file()


def test_the_config_they_train_passes_the_checks_before_launch():
    from stratagem.cli.train import check_before_launch
    from stratagem.config import Config

    check_before_launch(Config.fromfile(str(ROOT / CONFIG)))


@pytest.mark.parametrize('name', K8S)
def test_k8s_manifests_use_only_the_operators_variables(name):
    """The variables a manifest expands are the operator's; it sets none of them itself."""
    operator = OPERATOR_SETS[name]
    for argv, container, _ in k8s_commands(name, dict.fromkeys(operator, '0')):
        raw = container['command'] + container.get('args', [])
        own = {e['name'] for e in container.get('env', [])}
        assert referenced_vars(raw) <= operator | own, name
        assert not own & operator, f'{name} sets {own & operator}: the operator sets them'
        assert argv


def test_operators_variables_are_what_the_launcher_reads():
    sources = ''.join(
        (ROOT / 'stratagem' / f).read_text()
        for f in (
            'env/launcher.py',
            'env/cluster.py',
            'env/slurm.py',
            'cli/train.py',
            'cli/launch.py',
        )
    )
    for name, variables in OPERATOR_SETS.items():
        assert variables <= LAUNCHER_READS, f'{name}: {variables - LAUNCHER_READS}'
    read_now = {v for v in LAUNCHER_READS if re.search(rf'\b{v}\b', sources)}
    assert read_now == LAUNCHER_READS - PENDING, (
        'update PENDING: read now but pending',
        read_now & PENDING,
        'not read',
        (LAUNCHER_READS - PENDING) - read_now,
    )
