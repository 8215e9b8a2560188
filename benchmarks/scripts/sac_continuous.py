# Soft Actor-Critic, continuous actions (CleanRL sac_continuous_action.py style), with a synthetic
# MuJoCo-sized environment (obs 17, actions 6, like HalfCheetah-v4) generated on the GPU and a
# replay buffer of preallocated device tensors sampled with torch.randint.
import os
import random
import time
from dataclasses import dataclass, fields
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=False`"""
    cuda: bool = True
    """if toggled, cuda will be enabled by default"""

    # Algorithm specific arguments
    env_id: str = "SyntheticCheetah-v0"
    """the environment id of the task"""
    num_envs: int = 1
    """the number of parallel game environments"""
    obs_dim: int = 17
    """observation size"""
    act_dim: int = 6
    """action size"""
    buffer_size: int = int(1e5)
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient (default: 0.005)"""
    batch_size: int = 256
    """the batch size of sample from the reply memory"""
    learning_starts: int = 300
    """timestep to start learning"""
    steps: int = 3
    """gradient steps to run once learning has started"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1  # Denis Yarats' implementation delays this by 2.
    """the frequency of updates for the target nerworks"""
    alpha: float = 0.2
    """Entropy regularization coefficient."""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    hidden: int = 256
    """width of the actor and critic MLPs"""


def parse_args() -> Args:
    # tyro.cli(Args) in CleanRL; plain argparse over the dataclass fields here
    parser = argparse.ArgumentParser()
    for f in fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=f.default,
                                nargs="?", const=True)
        else:
            typ = f.type if callable(f.type) else eval(f.type)
            parser.add_argument(flag, type=typ, default=f.default)
    return Args(**vars(parser.parse_args()))


class SyntheticContinuousEnv:
    """Stands in for gym.vector.SyncVectorEnv([HalfCheetah-v4]): a vector env living on the GPU."""

    def __init__(self, num_envs, obs_dim, act_dim, device, max_episode_steps=1000):
        self.num_envs = num_envs
        self.obs_dim = obs_dim
        self.act_dim = act_dim
        self.device = device
        self.max_episode_steps = max_episode_steps
        self.action_low = -torch.ones(act_dim)
        self.action_high = torch.ones(act_dim)
        self.t = 0

    def reset(self, seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        self.t = 0
        return torch.randn(self.num_envs, self.obs_dim, device=self.device), {}

    def sample_actions(self):
        return torch.rand(self.num_envs, self.act_dim, device=self.device) * 2.0 - 1.0

    def step(self, actions):
        self.t += 1
        obs = torch.randn(self.num_envs, self.obs_dim, device=self.device)
        reward = -0.1 * actions.pow(2).sum(-1) + torch.randn(self.num_envs, device=self.device)
        terminations = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        truncations = torch.full((self.num_envs,), self.t >= self.max_episode_steps, device=self.device)
        return obs, reward, terminations, truncations, {}


class ReplayBuffer:
    """SB3's ReplayBuffer, but preallocated on the device."""

    def __init__(self, buffer_size, obs_dim, act_dim, device):
        self.buffer_size = buffer_size
        self.device = device
        self.observations = torch.zeros((buffer_size, obs_dim), dtype=torch.float32, device=device)
        self.next_observations = torch.zeros((buffer_size, obs_dim), dtype=torch.float32, device=device)
        self.actions = torch.zeros((buffer_size, act_dim), dtype=torch.float32, device=device)
        self.rewards = torch.zeros((buffer_size,), dtype=torch.float32, device=device)
        self.dones = torch.zeros((buffer_size,), dtype=torch.float32, device=device)
        self.pos = 0
        self.full = False

    def add(self, obs, next_obs, action, reward, done):
        n = obs.shape[0]
        idx = torch.arange(self.pos, self.pos + n, device=self.device) % self.buffer_size
        self.observations[idx] = obs
        self.next_observations[idx] = next_obs
        self.actions[idx] = action
        self.rewards[idx] = reward
        self.dones[idx] = done.float()
        self.pos = (self.pos + n) % self.buffer_size
        self.full = self.full or self.pos < n

    def sample(self, batch_size):
        upper = self.buffer_size if self.full else self.pos
        batch_inds = torch.randint(0, upper, (batch_size,), device=self.device)
        return (
            self.observations[batch_inds],
            self.actions[batch_inds],
            self.next_observations[batch_inds],
            self.dones[batch_inds],
            self.rewards[batch_inds],
        )


# ALGO LOGIC: initialize agent here:
class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + act_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
    def __init__(self, env, hidden):
        super().__init__()
        self.fc1 = nn.Linear(env.obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc_mean = nn.Linear(hidden, env.act_dim)
        self.fc_logstd = nn.Linear(hidden, env.act_dim)
        # action rescaling
        self.register_buffer("action_scale", ((env.action_high - env.action_low) / 2.0).float())
        self.register_buffer("action_bias", ((env.action_high + env.action_low) / 2.0).float())

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = self.fc_logstd(x)
        log_std = torch.tanh(log_std)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # From SpinUp / Denis Yarats

        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()  # for reparameterization trick (mean + std * N(0,1))
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing Action Bound
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


if __name__ == "__main__":
    args = parse_args()
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    # env setup
    envs = SyntheticContinuousEnv(args.num_envs, args.obs_dim, args.act_dim, device)

    actor = Actor(envs, args.hidden).to(device)
    qf1 = SoftQNetwork(envs.obs_dim, envs.act_dim, args.hidden).to(device)
    qf2 = SoftQNetwork(envs.obs_dim, envs.act_dim, args.hidden).to(device)
    qf1_target = SoftQNetwork(envs.obs_dim, envs.act_dim, args.hidden).to(device)
    qf2_target = SoftQNetwork(envs.obs_dim, envs.act_dim, args.hidden).to(device)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.policy_lr)

    # Automatic entropy tuning
    if args.autotune:
        target_entropy = -torch.prod(torch.Tensor((envs.act_dim,)).to(device)).item()
        log_alpha = torch.zeros(1, requires_grad=True, device=device)
        alpha = log_alpha.exp().item()
        a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)
    else:
        alpha = args.alpha

    rb = ReplayBuffer(args.buffer_size, envs.obs_dim, envs.act_dim, device)
    online_params = list(qf1.parameters()) + list(qf2.parameters())
    target_params = list(qf1_target.parameters()) + list(qf2_target.parameters())
    start_time = time.time()

    # TRY NOT TO MODIFY: start the game
    obs, _ = envs.reset(seed=args.seed)
    total_timesteps = args.learning_starts + args.steps + 1
    for global_step in range(total_timesteps):
        # ALGO LOGIC: put action logic here
        if global_step < args.learning_starts:
            actions = envs.sample_actions()
        else:
            with torch.no_grad():
                actions, _, _ = actor.get_action(obs)

        # TRY NOT TO MODIFY: execute the game and log data.
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        # TRY NOT TO MODIFY: save data to reply buffer; handle `final_observation`
        rb.add(obs, next_obs, actions, rewards, terminations)

        # TRY NOT TO MODIFY: CRUCIAL step easy to overlook
        obs = next_obs

        # ALGO LOGIC: training.
        if global_step > args.learning_starts:
            observations, b_actions, next_observations, dones, b_rewards = rb.sample(args.batch_size)
            with torch.no_grad():
                next_state_actions, next_state_log_pi, _ = actor.get_action(next_observations)
                qf1_next_target = qf1_target(next_observations, next_state_actions)
                qf2_next_target = qf2_target(next_observations, next_state_actions)
                min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
                next_q_value = b_rewards.flatten() + (1 - dones.flatten()) * args.gamma * (min_qf_next_target).view(-1)

            qf1_a_values = qf1(observations, b_actions).view(-1)
            qf2_a_values = qf2(observations, b_actions).view(-1)
            qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
            qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
            qf_loss = qf1_loss + qf2_loss

            # optimize the model
            q_optimizer.zero_grad()
            qf_loss.backward()
            q_optimizer.step()

            if global_step % args.policy_frequency == 0:  # TD 3 Delayed update support
                for _ in range(
                    args.policy_frequency
                ):  # compensate for the delay by doing 'actor_update_interval' instead of 1
                    pi, log_pi, _ = actor.get_action(observations)
                    qf1_pi = qf1(observations, pi)
                    qf2_pi = qf2(observations, pi)
                    min_qf_pi = torch.min(qf1_pi, qf2_pi)
                    actor_loss = ((alpha * log_pi) - min_qf_pi).mean()

                    actor_optimizer.zero_grad()
                    actor_loss.backward()
                    actor_optimizer.step()

                    if args.autotune:
                        with torch.no_grad():
                            _, log_pi, _ = actor.get_action(observations)
                        alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()

                        a_optimizer.zero_grad()
                        alpha_loss.backward()
                        a_optimizer.step()
                        alpha = log_alpha.exp().item()

            # update the target networks (Polyak averaging)
            if global_step % args.target_network_frequency == 0:
                with torch.no_grad():
                    torch._foreach_lerp_(target_params, online_params, args.tau)

            if global_step % 100 == 0 or global_step == total_timesteps - 1:
                print(
                    f"step={global_step} qf_loss={qf_loss.item() / 2.0:.4f} "
                    f"alpha={alpha:.4f} SPS={int(global_step / (time.time() - start_time))}"
                )
