"""Role detection for every launcher convention, and its error cases."""

from __future__ import annotations

import pytest

from fleet.roles import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker, detect
from fleet.runtime.env import EnvError, EnvReader


def roles(environ: dict[str, str], servers: int = 0):
    return detect(EnvReader(environ), servers=servers)


def test_no_launcher_is_a_single_worker():
    info = roles({})
    assert (info.role, info.worker_index, info.worker_num, info.server_num, info.source) == (
        Role.WORKER,
        0,
        1,
        0,
        "single",
    )
    assert info.is_first_worker and info.master is None


def test_fleetrun_worker_and_server():
    base = {"FLEET_WORKER_NUM": "2", "FLEET_SERVER_NUM": "2", "FLEET_SERVER_ENDPOINTS": "127.0.0.1:7001,127.0.0.1:7002"}
    worker = roles({**base, "FLEET_ROLE": "worker", "FLEET_WORKER_INDEX": "1"})
    assert (worker.role, worker.worker_index, worker.worker_num, worker.source) == (Role.WORKER, 1, 2, "fleetrun")
    assert worker.server_endpoints == ("127.0.0.1:7001", "127.0.0.1:7002")
    server = roles({**base, "FLEET_ROLE": "server", "FLEET_SERVER_INDEX": "1"})
    assert (server.role, server.server_index, server.name) == (Role.SERVER, 1, "server 1")


def test_fleetrun_collective_needs_a_master():
    with pytest.raises(EnvError, match="FLEET_MASTER"):
        roles({"FLEET_ROLE": "worker", "FLEET_WORKER_INDEX": "0", "FLEET_WORKER_NUM": "2"})


def test_paddle_trainer_and_pserver():
    base = {
        "PADDLE_TRAINERS_NUM": "2",
        "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6170,127.0.0.1:6171",
    }
    trainer = roles({**base, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1"})
    assert (trainer.role, trainer.worker_index, trainer.server_num, trainer.source) == (Role.WORKER, 1, 2, "paddle")
    server = roles({**base, "TRAINING_ROLE": "PSERVER", "POD_IP": "127.0.0.1", "PADDLE_PORT": "6171"})
    assert (server.role, server.server_index) == (Role.SERVER, 1)


def test_paddle_collective_uses_first_trainer_endpoint_as_master():
    info = roles(
        {
            "PADDLE_TRAINER_ID": "1",
            "PADDLE_TRAINERS_NUM": "2",
            "PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.2:6170",
        }
    )
    assert info.master == "10.0.0.1:6170" and info.worker_index == 1


@pytest.mark.parametrize(
    "environ, fragment",
    [
        ({"TRAINING_ROLE": "BOSS", "PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1"}, "TRAINING_ROLE='BOSS'"),
        (
            {"PADDLE_TRAINER_ID": "2", "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ENDPOINTS": "a:1,b:2"},
            "PADDLE_TRAINER_ID=2",
        ),
        ({"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2"}, "PADDLE_TRAINER_ENDPOINTS"),
        (
            {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ENDPOINTS": "hostonly,b:2"},
            "'hostonly'",
        ),
        ({"TRAINING_ROLE": "PSERVER", "PADDLE_TRAINERS_NUM": "1"}, "PADDLE_PSERVERS_IP_PORT_LIST"),
        (
            {
                "TRAINING_ROLE": "PSERVER",
                "PADDLE_TRAINERS_NUM": "1",
                "PADDLE_PSERVERS_IP_PORT_LIST": "h:1",
                "POD_IP": "h",
                "PADDLE_PORT": "2",
            },
            "'h:2' is not in",
        ),
        ({"PADDLE_TRAINER_ID": "x", "PADDLE_TRAINERS_NUM": "1"}, "PADDLE_TRAINER_ID='x' is not an integer"),
    ],
)
def test_paddle_errors_name_the_variable(environ, fragment):
    with pytest.raises(EnvError) as error:
        roles(environ)
    assert fragment in str(error.value)


def test_torchrun_ranks_and_servers():
    base = {"WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    info = roles({**base, "RANK": "1"})
    assert (info.worker_index, info.worker_num, info.master, info.source) == (1, 4, "127.0.0.1:29555", "torchrun")
    server = roles({**base, "RANK": "0"}, servers=1)
    worker = roles({**base, "RANK": "3"}, servers=1)
    assert (server.role, server.server_index, server.server_num) == (Role.SERVER, 0, 1)
    assert (worker.role, worker.worker_index, worker.worker_num) == (Role.WORKER, 2, 3)
    agent = roles({**base, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert agent.external_store


def test_torchrun_errors():
    with pytest.raises(EnvError, match="RANK=4 must be at least 0 and below WORLD_SIZE=4"):
        roles({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(EnvError, match="MASTER_ADDR is not set"):
        roles({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(EnvError, match="servers=2"):
        roles({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, servers=2)


def test_mpi_openmpi_and_pmi():
    info = roles({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (info.worker_index, info.worker_num, info.source, info.local_rank) == (1, 2, "mpi", 1)
    assert info.master.startswith("127.0.0.1:")
    pmi = roles({"PMI_RANK": "0", "PMI_SIZE": "3", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "4000"})
    assert (pmi.worker_num, pmi.master) == (3, "10.1.1.1:4000")
    with pytest.raises(EnvError, match="OMPI_COMM_WORLD_SIZE=0"):
        roles({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"})


def test_mpi_jobs_derive_different_ports():
    a = roles({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_ess_base_jobid": "111"})
    b = roles({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_ess_base_jobid": "222"})
    assert a.master != b.master


def test_slurm():
    info = roles({"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"})
    assert (info.worker_index, info.worker_num, info.source) == (2, 3, "slurm")
    with pytest.raises(EnvError, match="SLURM_PROCID=3"):
        roles({"SLURM_PROCID": "3", "SLURM_NTASKS": "3"})


def test_detection_order_prefers_fleetrun_then_paddle_then_torchrun():
    environ = {
        "FLEET_ROLE": "worker",
        "FLEET_WORKER_INDEX": "0",
        "FLEET_WORKER_NUM": "1",
        "PADDLE_TRAINER_ID": "0",
        "PADDLE_TRAINERS_NUM": "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "1",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    assert roles(environ).source == "fleetrun"
    del environ["FLEET_ROLE"]
    assert roles(environ).source == "paddle"
    del environ["PADDLE_TRAINER_ID"]
    assert roles(environ).source == "torchrun"
    del environ["RANK"]
    assert roles(environ).source == "mpi"
    del environ["OMPI_COMM_WORLD_RANK"]
    assert roles(environ).source == "slurm"


def test_role_makers():
    maker = UserDefinedRoleMaker(
        role=Role.SERVER, current_id=1, worker_num=3, server_endpoints=["127.0.0.1:1", "127.0.0.1:2"]
    )
    info = maker.role_info()
    assert (info.role, info.server_index, info.worker_num, info.source) == (Role.SERVER, 1, 3, "user")
    with pytest.raises(ValueError, match="worker_index"):
        UserDefinedRoleMaker(current_id=3, worker_num=2)
    cloud = PaddleCloudRoleMaker(environ={"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1"})
    assert cloud.role_info().source == "paddle"


def test_role_info_is_frozen():
    info = roles({})
    with pytest.raises(Exception, match="frozen"):
        info.worker_index = 3
