"""SkyRL on two nodes through one `tangram serve --ray`.

    pip install '.[ray]' skyrl-gym
    python examples/integrations/skyrl_multinode.py

SkyRL steps its environments in Ray workers; here one on each of two nodes runs an
episode of TangramCodeEnv (each step's code is one action in the episode's sandbox, the
answer scored on test cases), with no address given: each finds the server the cluster
advertises. The server's action log then shows one scheduler placing every action.
"""

from _cluster import on_every_node, report, tangram_on_a_cluster


def rollout_worker(i: int) -> tuple[bool, float]:
    from tangram.integrations.skyrl import TangramCodeEnv

    env = TangramCodeEnv({"timeout": 10}, {"max_turns": 2, "reward_spec": {
        "ground_truth": {"inputs": ["2 3\n", f"40 {i}\n"], "outputs": ["5", str(40 + i)]}}})
    env.step("```python\nprint(sum([2, 3]))\n```")
    final = env.step("```python\nprint(sum(map(int, input().split())))\n```")
    env.close()
    return final["done"], final["reward"]


with tangram_on_a_cluster() as log:
    for i, (done, reward) in enumerate(on_every_node(rollout_worker)):
        print(f"worker {i}: done {done} reward {reward}")
report(log)
