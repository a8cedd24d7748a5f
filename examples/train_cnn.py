"""Train a small CNN with PyTorch's batch norm or bngrad's, on images generated here.

The data set is drawn on the fly (nothing is downloaded): 16x16 grey images of four kinds of
shape — a horizontal bar, a vertical bar, a diagonal line, a filled square — at random
positions and sizes, with noise. The model is three conv - batch norm - ReLU stages and a
linear classifier; ``--bn bngrad`` swaps its batch norms for bngrad's with
``bngrad.torch.convert`` (same weights, same state_dict).

    python examples/train_cnn.py --bn torch
    python examples/train_cnn.py --bn bngrad --epochs 5 --channels-last
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

CLASSES = ("horizontal bar", "vertical bar", "diagonal", "square")


def make_shapes(n: int, size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (n, 1, size, size) with labels 0..3, drawn with a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(CLASSES), (n,), generator=gen)
    images = torch.zeros(n, 1, size, size)
    for i, label in enumerate(labels.tolist()):
        length = int(torch.randint(6, size - 2, (1,), generator=gen))
        r, c = (int(v) for v in torch.randint(0, size - length + 1, (2,), generator=gen))
        thick = int(torch.randint(1, 3, (1,), generator=gen))
        if label == 0:
            images[i, 0, r:r + thick, c:c + length] = 1.0
        elif label == 1:
            images[i, 0, r:r + length, c:c + thick] = 1.0
        elif label == 2:
            idx = torch.arange(length)
            images[i, 0, r + idx, c + idx] = 1.0
        else:
            side = max(3, length // 2)
            images[i, 0, r:r + side, c:c + side] = 1.0
    images += 0.3 * torch.randn(images.shape, generator=gen)
    return images, labels


def make_model() -> nn.Module:
    def stage(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*stage(1, 16), *stage(16, 32), *stage(32, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, len(CLASSES)))


def evaluate(model, images, labels, batch_size, memory_format):
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            x = images[start:start + batch_size].to(memory_format=memory_format)
            y = labels[start:start + batch_size]
            logits = model(x)
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
    return loss / len(images), correct / len(images)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bn", choices=["torch", "bngrad"], default="bngrad",
                        help="whose batch norm the model uses (default: bngrad)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    train_x, train_y = make_shapes(args.train_size, seed=args.seed)
    test_x, test_y = make_shapes(1024, seed=args.seed + 1)

    model = make_model().to(memory_format=memory_format)
    if args.bn == "bngrad":
        import bngrad.torch
        model = bngrad.torch.convert(model)
        if args.threads:
            import numba
            numba.set_num_threads(args.threads)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    print(f"batch norm: {args.bn}; {len(train_x)} training and {len(test_x)} test images; "
          f"threads: {torch.get_num_threads()}")

    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(len(train_x))
        t0, seen, running = time.perf_counter(), 0, 0.0
        for start in range(0, len(train_x), args.batch_size):
            idx = perm[start:start + args.batch_size]
            x = train_x[idx].to(memory_format=memory_format)
            loss = nn.functional.cross_entropy(model(x), train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item() * len(idx)
            seen += len(idx)
        elapsed = time.perf_counter() - t0
        test_loss, test_acc = evaluate(model, test_x, test_y, 256, memory_format)
        print(f"epoch {epoch}: train loss {running / seen:.4f}  test loss {test_loss:.4f}  "
              f"test accuracy {test_acc:.1%}  ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
