/* A trainer written the way plain C trainers are (llm.c's GPT-2 is the model
 * of it), to fit the library to without rewriting its model code:
 *   - one array per kind of parameter, stacked across layers (w1 holds every
 *     layer's first matrix back to back), and the gradients in the same
 *     layout in a second block;
 *   - a tied embedding: wte is the input embedding and the output layer, so
 *     its gradient is written at the start of backward (the output layer)
 *     and again at the end (the lookup);
 *   - backward accumulates (+=) into gradients the caller zeroed.
 * The model: a next-token predictor over a vocabulary of V tokens, width C,
 * L residual MLP blocks x += W2 relu(W1 x + b1) + b2, logits = wte x. The
 * only integration points are optional hooks around each unit's use (the
 * embedding is unit 0, block l is unit 1 + l), which is where an
 * optimizer that shards parameters gathers them.
 *
 * Plain C (compiles as C and as C++); no allocation after ct_alloc. */
#ifndef ZERO_TESTS_ENGINE_C_STYLE_TRAINER_H
#define ZERO_TESTS_ENGINE_C_STYLE_TRAINER_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
  int V, C, L, B; /* vocabulary, width, blocks, examples per batch */
} CtConfig;

/* Pointers into one block of memory: the parameters, or the gradients. */
typedef struct {
  float* wte; /* V x C */
  float* w1;  /* L x C x C (out, in) */
  float* b1;  /* L x C */
  float* w2;  /* L x C x C */
  float* b2;  /* L x C */
} CtTensors;

static size_t ct_sizes(const CtConfig* c, size_t sizes[5]) {
  const size_t V = (size_t)c->V, C = (size_t)c->C, L = (size_t)c->L;
  sizes[0] = V * C;
  sizes[1] = L * C * C;
  sizes[2] = L * C;
  sizes[3] = L * C * C;
  sizes[4] = L * C;
  return sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4];
}

/* Points the tensors into `memory` (ct_sizes()'s total floats). Each kind
 * starts on a 4 KiB boundary when the memory does and C x C x 4 is a
 * multiple of 4 KiB (C = 32, 64, ...): a layer's slice is whole pages. */
static void ct_point(const CtConfig* c, float* memory, CtTensors* t) {
  size_t s[5];
  ct_sizes(c, s);
  t->wte = memory;
  t->w1 = t->wte + s[0];
  t->w2 = t->w1 + s[1];
  t->b1 = t->w2 + s[3];
  t->b2 = t->b1 + s[2];
}

/* Activations of one batch. */
typedef struct {
  int* tokens;   /* B */
  int* targets;  /* B */
  float* x;      /* (L + 1) x B x C: each block's input, then the output */
  float* pre;    /* L x B x C: W1 x + b1 */
  float* hidden; /* L x B x C: relu(pre) */
  float* probs;  /* B x V */
  float* dx;     /* B x C */
  float* dh;     /* B x C */
} CtActs;

static size_t ct_act_floats(const CtConfig* c) {
  const size_t B = (size_t)c->B, C = (size_t)c->C, L = (size_t)c->L, V = (size_t)c->V;
  return (L + 1) * B * C + 2 * L * B * C + B * V + 2 * B * C;
}
static void ct_point_acts(const CtConfig* c, float* memory, int* ints, CtActs* a) {
  const size_t B = (size_t)c->B, C = (size_t)c->C, L = (size_t)c->L, V = (size_t)c->V;
  a->tokens = ints;
  a->targets = ints + B;
  a->x = memory;
  a->pre = a->x + (L + 1) * B * C;
  a->hidden = a->pre + L * B * C;
  a->probs = a->hidden + L * B * C;
  a->dx = a->probs + B * V;
  a->dh = a->dx + B * C;
}

/* Where an optimizer that shards parameters gathers and releases them, and
 * learns that a unit's gradient is complete. Any may be null. */
typedef struct {
  void* ctx;
  void (*acquire)(void* ctx, int unit);
  void (*release)(void* ctx, int unit);
  void (*grad_done)(void* ctx, int unit);
} CtHooks;

static void ct_hook(void (*f)(void*, int), void* ctx, int unit) {
  if (f) f(ctx, unit);
}

/* A deterministic initialisation (the same on every process). */
static float ct_uniform(uint64_t* state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((double)(*state >> 40) / 16777216.0) * 2.0f - 1.0f;
}
static void ct_init(const CtConfig* c, const CtTensors* p, uint64_t seed) {
  size_t s[5];
  const size_t n = ct_sizes(c, s);
  const float scale = 1.0f / sqrtf((float)c->C);
  for (size_t i = 0; i < n; ++i) p->wte[i] = 0.5f * scale * ct_uniform(&seed);
  memset(p->b1, 0, (s[2] + s[4]) * sizeof(float));
}

/* The batch of `step` for examples [first, first + c->B) of the global
 * batch: one of the first 16 tokens, t, predicts (5 t + 3) mod V. */
static void ct_batch(const CtConfig* c, int step, int first, CtActs* a) {
  for (int i = 0; i < c->B; ++i) {
    const uint64_t h = (uint64_t)(step * 7919 + first + i) * 0x9E3779B97F4A7C15ull;
    a->tokens[i] = (int)((h >> 33) % (uint64_t)(c->V < 16 ? c->V : 16));
    a->targets[i] = (5 * a->tokens[i] + 3) % c->V;
  }
}

/* y[n] (+)= W[n][k] x[k] + b[n] for each example. */
static void ct_matvec(float* y, const float* w, const float* b, const float* x, int rows, int cols) {
  for (int n = 0; n < rows; ++n) {
    float s = b ? b[n] : 0.0f;
    for (int k = 0; k < cols; ++k) s += w[(size_t)n * cols + k] * x[k];
    y[n] = s;
  }
}

/* Forward of one batch; returns the mean loss and leaves the output
 * layer's probabilities in a->probs and the embedding (unit 0) acquired:
 * ct_backward goes on from there, an evaluation releases it. */
static float ct_forward(const CtConfig* c, const CtTensors* p, CtActs* a, const CtHooks* hooks) {
  const int V = c->V, C = c->C, L = c->L, B = c->B;
  const size_t BC = (size_t)B * C, CC = (size_t)C * C;
  /* Embedding. */
  ct_hook(hooks->acquire, hooks->ctx, 0);
  for (int i = 0; i < B; ++i) memcpy(a->x + (size_t)i * C, p->wte + (size_t)a->tokens[i] * C, C * sizeof(float));
  ct_hook(hooks->release, hooks->ctx, 0);
  /* Blocks. */
  for (int l = 0; l < L; ++l) {
    ct_hook(hooks->acquire, hooks->ctx, 1 + l);
    const float *w1 = p->w1 + l * CC, *b1 = p->b1 + (size_t)l * C, *w2 = p->w2 + l * CC, *b2 = p->b2 + (size_t)l * C;
    for (int i = 0; i < B; ++i) {
      const float* x = a->x + l * BC + (size_t)i * C;
      float* pre = a->pre + l * BC + (size_t)i * C;
      float* h = a->hidden + l * BC + (size_t)i * C;
      float* out = a->x + (l + 1) * BC + (size_t)i * C;
      ct_matvec(pre, w1, b1, x, C, C);
      for (int k = 0; k < C; ++k) h[k] = pre[k] > 0.0f ? pre[k] : 0.0f;
      ct_matvec(out, w2, b2, h, C, C);
      for (int k = 0; k < C; ++k) out[k] += x[k];
    }
    ct_hook(hooks->release, hooks->ctx, 1 + l);
  }
  /* Output layer: the tied embedding again; its gradient is the first of backward. */
  ct_hook(hooks->acquire, hooks->ctx, 0);
  float loss = 0.0f;
  for (int i = 0; i < B; ++i) {
    const float* x = a->x + L * BC + (size_t)i * C;
    float* pr = a->probs + (size_t)i * V;
    ct_matvec(pr, p->wte, NULL, x, V, C);
    float m = pr[0];
    for (int v = 1; v < V; ++v) m = pr[v] > m ? pr[v] : m;
    const float target_logit = pr[a->targets[i]];
    float z = 0.0f;
    for (int v = 0; v < V; ++v) z += (pr[v] = expf(pr[v] - m));
    for (int v = 0; v < V; ++v) pr[v] /= z;
    loss -= (target_logit - m - logf(z)) / (float)B;
  }
  return loss;
}

/* Backward of the batch ct_forward ran. Gradients are added (+=) into `g`,
 * which the caller zeroed. */
static void ct_backward(const CtConfig* c, const CtTensors* p, const CtTensors* g, CtActs* a,
                        const CtHooks* hooks) {
  const int V = c->V, C = c->C, L = c->L, B = c->B;
  const size_t BC = (size_t)B * C, CC = (size_t)C * C;
  for (int i = 0; i < B; ++i) {
    const float* x = a->x + L * BC + (size_t)i * C;
    float* pr = a->probs + (size_t)i * V; /* becomes dlogits */
    float* dx = a->dx + (size_t)i * C;
    pr[a->targets[i]] -= 1.0f;
    for (int v = 0; v < V; ++v) pr[v] /= (float)B;
    memset(dx, 0, C * sizeof(float));
    for (int v = 0; v < V; ++v)
      for (int k = 0; k < C; ++k) {
        g->wte[(size_t)v * C + k] += pr[v] * x[k];
        dx[k] += p->wte[(size_t)v * C + k] * pr[v];
      }
  }
  ct_hook(hooks->release, hooks->ctx, 0);
  /* Blocks, backwards. */
  for (int l = L - 1; l >= 0; --l) {
    ct_hook(hooks->acquire, hooks->ctx, 1 + l);
    const float *w1 = p->w1 + l * CC, *w2 = p->w2 + l * CC;
    float *gw1 = g->w1 + l * CC, *gb1 = g->b1 + (size_t)l * C, *gw2 = g->w2 + l * CC, *gb2 = g->b2 + (size_t)l * C;
    for (int i = 0; i < B; ++i) {
      const float* x = a->x + l * BC + (size_t)i * C;
      const float* pre = a->pre + l * BC + (size_t)i * C;
      const float* h = a->hidden + l * BC + (size_t)i * C;
      float* dx = a->dx + (size_t)i * C; /* d(out): the residual passes it through */
      float* dh = a->dh + (size_t)i * C;
      for (int n = 0; n < C; ++n) {
        gb2[n] += dx[n];
        for (int k = 0; k < C; ++k) gw2[(size_t)n * C + k] += dx[n] * h[k];
      }
      for (int k = 0; k < C; ++k) {
        float s = 0.0f;
        for (int n = 0; n < C; ++n) s += w2[(size_t)n * C + k] * dx[n];
        dh[k] = pre[k] > 0.0f ? s : 0.0f;
      }
      for (int n = 0; n < C; ++n) {
        gb1[n] += dh[n];
        for (int k = 0; k < C; ++k) gw1[(size_t)n * C + k] += dh[n] * x[k];
      }
      for (int k = 0; k < C; ++k) {
        float s = 0.0f;
        for (int n = 0; n < C; ++n) s += w1[(size_t)n * C + k] * dh[n];
        dx[k] += s;
      }
    }
    ct_hook(hooks->grad_done, hooks->ctx, 1 + l);
    ct_hook(hooks->release, hooks->ctx, 1 + l);
  }
  /* The lookup's gradient: the embedding's second, last. */
  for (int i = 0; i < B; ++i)
    for (int k = 0; k < C; ++k) g->wte[(size_t)a->tokens[i] * C + k] += a->dx[(size_t)i * C + k];
  ct_hook(hooks->grad_done, hooks->ctx, 0);
}

/* One training batch: the mean loss; gradients added into `g`. */
static float ct_forward_backward(const CtConfig* c, const CtTensors* p, const CtTensors* g, CtActs* a,
                                 const CtHooks* hooks) {
  const float loss = ct_forward(c, p, a, hooks);
  ct_backward(c, p, g, a, hooks);
  return loss;
}

#endif
