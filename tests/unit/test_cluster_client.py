"""The cluster client that connect() builds, without a cluster: what it is set up with."""
from shared.redis_client import connect


def test_the_seeds_can_change_while_the_client_walks_them():
    """redis-py walks the seeds (awaiting each) to refresh its map of the slots, while a command
    that lost its node removes that node from them; a master's death crashed a worker on it."""
    client = connect("redis+cluster://10.0.0.1:7000,10.0.0.2:7001,10.0.0.3:7002")
    seeds = client.nodes_manager.startup_nodes
    walked = []
    for node in seeds.values():
        walked.append(node.name)
        seeds.pop("10.0.0.2:7001", None)  # what execute_command does on a ConnectionError
    assert walked == ["10.0.0.1:7000", "10.0.0.2:7001", "10.0.0.3:7002"]
    assert list(seeds) == ["10.0.0.1:7000", "10.0.0.3:7002"]
