"""An ordinary single-machine PyTorch training script (synthetic data, no downloads)."""

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
features = torch.randn(4096, 32)
labels = (features[:, :4].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(features, labels), batch_size=64, shuffle=True)

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    scheduler.step()
    print(f"epoch {epoch} loss {loss.item():.4f}")
