# Reinforcement Learning (DQN) Tutorial style (pytorch/tutorials reinforcement_q_learning.py) with a fake vectorized env on the host
import argparse
import math
import random
from collections import namedtuple, deque
from itertools import count

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torch.nn.functional as F

parser = argparse.ArgumentParser(description='PyTorch DQN')
parser.add_argument('--num-episodes', type=int, default=1)
parser.add_argument('--max-t', type=int, default=12, help='env steps per episode')
parser.add_argument('--num-envs', type=int, default=1024)
parser.add_argument('--hidden', type=int, default=8192)
parser.add_argument('--seed', type=int, default=0)
args = parser.parse_args()


class FakeVectorEnv:
    """Stands in for gym.vector.SyncVectorEnv: random float observations, numpy on the host."""

    def __init__(self, num_envs, n_observations, n_actions):
        self.num_envs = num_envs
        self.n_observations = n_observations
        self.n_actions = n_actions

    def reset(self):
        return np.random.randn(self.num_envs, self.n_observations).astype(np.float32), {}

    def sample_actions(self):
        return np.random.randint(0, self.n_actions, size=self.num_envs)

    def step(self, action):
        observation = np.random.randn(self.num_envs, self.n_observations).astype(np.float32)
        reward = np.random.rand(self.num_envs).astype(np.float32)
        terminated = np.random.rand(self.num_envs) < 0.05
        truncated = np.zeros(self.num_envs, dtype=bool)
        return observation, reward, terminated, truncated, {}


random.seed(args.seed)
np.random.seed(args.seed)
torch.manual_seed(args.seed)

env = FakeVectorEnv(args.num_envs, n_observations=256, n_actions=18)

# if GPU is to be used
device = torch.device(
    "cuda" if torch.cuda.is_available() else
    "mps" if torch.backends.mps.is_available() else
    "cpu"
)


######################################################################
# Replay Memory

Transition = namedtuple('Transition',
                        ('state', 'action', 'next_state', 'reward'))


class ReplayMemory(object):

    def __init__(self, capacity):
        self.memory = deque([], maxlen=capacity)

    def push(self, *args):
        """Save a transition"""
        self.memory.append(Transition(*args))

    def sample(self, batch_size):
        return random.sample(self.memory, batch_size)

    def __len__(self):
        return len(self.memory)


######################################################################
# Q-network

class DQN(nn.Module):

    def __init__(self, n_observations, n_actions, hidden=128):
        super(DQN, self).__init__()
        self.layer1 = nn.Linear(n_observations, hidden)
        self.layer2 = nn.Linear(hidden, hidden)
        self.layer3 = nn.Linear(hidden, n_actions)

    # Called with either one element to determine next action, or a batch
    # during optimization. Returns tensor([[left0exp,right0exp]...]).
    def forward(self, x):
        x = F.relu(self.layer1(x))
        x = F.relu(self.layer2(x))
        return self.layer3(x)


######################################################################
# Training

# BATCH_SIZE is the number of transitions sampled from the replay buffer
# GAMMA is the discount factor as mentioned in the previous section
# EPS_START is the starting value of epsilon
# EPS_END is the final value of epsilon
# EPS_DECAY controls the rate of exponential decay of epsilon, higher means a slower decay
# TAU is the update rate of the target network
# LR is the learning rate of the ``AdamW`` optimizer
BATCH_SIZE = 4096
GAMMA = 0.99
EPS_START = 0.9
EPS_END = 0.05
EPS_DECAY = 1000
TAU = 0.005
LR = 1e-4

# Get number of actions from gym action space
n_actions = env.n_actions
# Get the number of state observations
state, info = env.reset()
n_observations = state.shape[1]

policy_net = DQN(n_observations, n_actions, args.hidden).to(device)
target_net = DQN(n_observations, n_actions, args.hidden).to(device)
target_net.load_state_dict(policy_net.state_dict())

optimizer = optim.AdamW(policy_net.parameters(), lr=LR, amsgrad=True)
memory = ReplayMemory(10000)


steps_done = 0


def select_action(state):
    global steps_done
    sample = random.random()
    eps_threshold = EPS_END + (EPS_START - EPS_END) * \
        math.exp(-1. * steps_done / EPS_DECAY)
    steps_done += 1
    if sample > eps_threshold:
        with torch.no_grad():
            # t.max(1) will return the largest column value of each row.
            # second column on max result is index of where max element was
            # found, so we pick action with the larger expected reward.
            return policy_net(state).max(1).indices.view(-1, 1)
    else:
        return torch.tensor(env.sample_actions(), device=device, dtype=torch.long).view(-1, 1)


episode_durations = []


def optimize_model():
    if len(memory) < BATCH_SIZE:
        return
    transitions = memory.sample(BATCH_SIZE)
    # Transpose the batch (see https://stackoverflow.com/a/19343/3343043 for
    # detailed explanation). This converts batch-array of Transitions
    # to Transition of batch-arrays.
    batch = Transition(*zip(*transitions))

    # Compute a mask of non-final states and concatenate the batch elements
    # (a final state would've been the one after which simulation ended)
    non_final_mask = torch.tensor(tuple(map(lambda s: s is not None,
                                          batch.next_state)), device=device, dtype=torch.bool)
    non_final_next_states = torch.cat([s for s in batch.next_state
                                                if s is not None])
    state_batch = torch.cat(batch.state)
    action_batch = torch.cat(batch.action)
    reward_batch = torch.cat(batch.reward)

    # Compute Q(s_t, a) - the model computes Q(s_t), then we select the
    # columns of actions taken. These are the actions which would've been taken
    # for each batch state according to policy_net
    state_action_values = policy_net(state_batch).gather(1, action_batch)

    # Compute V(s_{t+1}) for all next states.
    # Expected values of actions for non_final_next_states are computed based
    # on the "older" target_net; selecting their best reward with max(1).values
    # This is merged based on the mask, such that we'll have either the expected
    # state value or 0 in case the state was final.
    next_state_values = torch.zeros(BATCH_SIZE, device=device)
    with torch.no_grad():
        next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values
    # Compute the expected Q values
    expected_state_action_values = (next_state_values * GAMMA) + reward_batch

    # Compute Huber loss
    criterion = nn.SmoothL1Loss()
    loss = criterion(state_action_values, expected_state_action_values.unsqueeze(1))

    # Optimize the model
    optimizer.zero_grad()
    loss.backward()
    # In-place gradient clipping
    torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
    optimizer.step()
    return loss


num_episodes = args.num_episodes

for i_episode in range(num_episodes):
    # Initialize the environment and get its state
    state, info = env.reset()
    state = torch.tensor(state, dtype=torch.float32, device=device)
    for t in count():
        action = select_action(state)
        observation, reward, terminated, truncated, _ = env.step(action.cpu().numpy())
        reward = torch.tensor(reward, device=device)
        done = terminated | truncated

        next_state = torch.tensor(observation, dtype=torch.float32, device=device)

        # Store the transition in memory, one per env
        for i in range(args.num_envs):
            memory.push(state[i:i + 1], action[i:i + 1],
                        None if terminated[i] else next_state[i:i + 1], reward[i:i + 1])

        # Move to the next state
        state = next_state

        # Perform one step of the optimization (on the policy network)
        loss = optimize_model()

        # Soft update of the target network's weights
        # θ′ ← τ θ + (1 −τ )θ′
        target_net_state_dict = target_net.state_dict()
        policy_net_state_dict = policy_net.state_dict()
        for key in policy_net_state_dict:
            target_net_state_dict[key] = policy_net_state_dict[key]*TAU + target_net_state_dict[key]*(1-TAU)
        target_net.load_state_dict(target_net_state_dict)

        if loss is not None:
            print(f"episode {i_episode} t {t} memory {len(memory)} loss {loss.item():.4f} done {int(done.sum())}")

        if t + 1 >= args.max_t:
            episode_durations.append(t + 1)
            break

print('Complete')
