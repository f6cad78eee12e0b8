/**
 * The application's state: chats (mirrored to IndexedDB), the server's health and model, and the answer being
 * streamed. Components read it and call its methods; nothing else writes it.
 */
import { buildRequest, getHealth, getModel, limits, streamChat, type Health, type ModelInfo } from './api';
import { ApiError, friendly } from './errors';
import { deleteChat, listChats, newChatId, saveChat } from './db';
import { answerStats } from './stats';
import { keptForEdit, keptForRegenerate } from './fork';
import {
  defaultSettings,
  type AssistantMessage,
  type Attachment,
  type Chat,
  type ChatSettings,
  type ImageAttachment,
  type UserMessage,
} from './types';

const TITLE_LENGTH = 48;

function titleFrom(text: string, attachments: Attachment[], images: ImageAttachment[]): string {
  const line = text.trim().split('\n')[0] ?? '';
  const base = line || (attachments[0] ? `About ${attachments[0].name}` : images[0] ? `Image: ${images[0].name}` : 'New chat');
  return base.length > TITLE_LENGTH ? `${base.slice(0, TITLE_LENGTH - 1)}…` : base;
}

class Store {
  chats = $state<Chat[]>([]);
  currentId = $state<string | null>(null);
  loaded = $state(false);
  /** `connecting` until the first health check answers. */
  health = $state<Health>({ state: 'connecting' });
  model = $state<ModelInfo | null>(null);
  /** Id of the chat whose answer is streaming, if any. */
  streamingChatId = $state<string | null>(null);
  /** The last failure to read chats (IndexedDB may be off in private windows). */
  storageError = $state<string | null>(null);

  private controller: AbortController | null = null;
  private healthTimer: ReturnType<typeof setTimeout> | null = null;

  current = $derived(this.chats.find((c) => c.id === this.currentId) ?? null);
  limits = $derived(limits(this.model));

  async init(): Promise<void> {
    try {
      const chats = await listChats();
      // An answer that was streaming when the page went away ends there.
      for (const c of chats) {
        for (const m of c.messages) {
          if (m.role === 'assistant' && m.streaming) {
            m.streaming = undefined;
            m.interrupted ??= 'stopped';
          }
        }
      }
      this.chats = chats;
    } catch (e) {
      this.storageError = `Chats cannot be saved in this browser (${e instanceof Error ? e.message : e}).`;
    }
    const fromHash = /^#\/chat\/(.+)$/.exec(location.hash)?.[1];
    this.currentId = this.chats.find((c) => c.id === fromHash)?.id ?? this.chats[0]?.id ?? null;
    if (!this.currentId) this.newChat();
    this.loaded = true;
    void this.pollHealth();
  }

  /** Checks `/health` now and again later: every 2 s until ready, then every 10 s. */
  async pollHealth(): Promise<void> {
    if (this.healthTimer) clearTimeout(this.healthTimer);
    this.healthTimer = null;
    const before = this.health.state;
    const h = await getHealth();
    this.health = h;
    if (h.state === 'ok' && (before !== 'ok' || !this.model)) {
      try {
        this.model = await getModel();
      } catch {
        /* the status page says what is missing */
      }
    }
    this.healthTimer = setTimeout(() => void this.pollHealth(), h.state === 'ok' ? 10_000 : 2_000);
  }

  newChat(): Chat {
    // An empty chat is reused rather than stacked up.
    const empty = this.chats.find((c) => c.messages.length === 0);
    if (empty) {
      this.currentId = empty.id;
      return empty;
    }
    const now = Date.now();
    const base = this.current?.settings ?? defaultSettings();
    const chat: Chat = {
      id: newChatId(),
      title: 'New chat',
      createdAt: now,
      updatedAt: now,
      messages: [],
      // A new chat starts with the settings of the one open before it, except its system prompt.
      settings: { ...$state.snapshot(base), system: "" },
    };
    this.chats.unshift(chat);
    this.currentId = chat.id;
    return this.chats[0];
  }

  select(id: string): void {
    this.currentId = id;
  }

  async rename(id: string, title: string): Promise<void> {
    const chat = this.chats.find((c) => c.id === id);
    const t = title.trim();
    if (!chat || !t) return;
    chat.title = t.slice(0, 200);
    await this.persist(chat);
  }

  async remove(id: string): Promise<void> {
    if (this.streamingChatId === id) this.stop();
    try {
      await deleteChat(id);
    } catch (e) {
      this.storageError = `This chat could not be deleted (${e instanceof Error ? e.message : e}).`;
      return;
    }
    const i = this.chats.findIndex((c) => c.id === id);
    if (i < 0) return;
    this.chats.splice(i, 1);
    if (this.currentId === id) {
      this.currentId = this.chats[Math.min(i, this.chats.length - 1)]?.id ?? null;
      if (!this.currentId) this.newChat();
    }
  }

  async updateSettings(chat: Chat, patch: Partial<ChatSettings>): Promise<void> {
    Object.assign(chat.settings, patch);
    if (chat.messages.length > 0) await this.persist(chat);
  }

  /** Saves `chat` unless it is still empty (an empty chat lives only in this tab). */
  async persist(chat: Chat): Promise<void> {
    if (chat.messages.length === 0) return;
    try {
      await saveChat($state.snapshot(chat) as Chat);
      this.storageError = null;
    } catch (e) {
      this.storageError = `This chat could not be saved (${e instanceof Error ? e.message : e}).`;
    }
  }

  /** The context limit an answer in `chat` runs under. */
  contextLimit(chat: Chat): number | undefined {
    return chat.settings.contextLength ?? this.limits.maxContext;
  }

  /** Sends `text` (with documents and images) as the next user message of `chat`, and streams the answer. */
  async send(chat: Chat, text: string, attachments: Attachment[], images: ImageAttachment[] = []): Promise<void> {
    if (this.streamingChatId) return;
    if (chat.messages.length === 0) chat.title = titleFrom(text, attachments, images);
    chat.messages.push(userMessage(text, attachments, images));
    await this.answer(chat);
  }

  /**
   * Replaces the user message at `index` of `chat` with a new text (and documents and images), drops everything
   * after it, and streams the answer: the conversation forks there (see `fork.ts`).
   */
  async edit(chat: Chat, index: number, text: string, attachments: Attachment[], images: ImageAttachment[]): Promise<void> {
    if (this.streamingChatId) return;
    const kept = keptForEdit(chat.messages, index);
    if (kept === null) return;
    chat.messages.splice(kept, chat.messages.length - kept, userMessage(text, attachments, images));
    await this.answer(chat);
  }

  /** Drops the answer at `index` of `chat` and everything after it, and answers its question again. */
  async regenerate(chat: Chat, index: number): Promise<void> {
    if (this.streamingChatId) return;
    const kept = keptForRegenerate(chat.messages, index);
    if (kept === null) return;
    chat.messages.splice(kept);
    await this.answer(chat);
  }

  /** Answers the last user message of `chat` again (after an error). */
  async retry(chat: Chat): Promise<void> {
    await this.regenerate(chat, chat.messages.length - 1);
  }

  private async answer(chat: Chat): Promise<void> {
    const history = $state.snapshot(chat.messages);
    chat.messages.push({ role: 'assistant', content: '', reasoning: '', streaming: true, at: Date.now() });
    const msg = chat.messages[chat.messages.length - 1] as AssistantMessage;
    chat.updatedAt = Date.now();
    // Most recently used first.
    const i = this.chats.indexOf(chat);
    if (i > 0) this.chats.unshift(...this.chats.splice(i, 1));
    await this.persist(chat);

    const body = buildRequest(this.model?.id, history, $state.snapshot(chat.settings) as ChatSettings);
    const controller = new AbortController();
    this.controller = controller;
    this.streamingChatId = chat.id;
    let deltas = 0;
    let lastSave = performance.now();
    // Deltas are gathered and shown at most every 50 ms: each update re-renders the message's Markdown.
    let pendingReasoning = '';
    let pendingContent = '';
    let flushTimer: ReturnType<typeof setTimeout> | null = null;
    const flush = () => {
      if (flushTimer) clearTimeout(flushTimer);
      flushTimer = null;
      if (pendingReasoning) msg.reasoning = (msg.reasoning ?? '') + pendingReasoning;
      if (pendingContent) msg.content += pendingContent;
      pendingReasoning = pendingContent = '';
      if (performance.now() - lastSave > 2000) {
        lastSave = performance.now();
        void this.persist(chat);
      }
    };
    const later = () => {
      flushTimer ??= setTimeout(flush, 50);
    };
    const sentAt = performance.now();
    let firstTokenAt: number | undefined;
    try {
      const result = await streamChat(
        body,
        {
          onReasoning: (t) => {
            firstTokenAt ??= performance.now();
            pendingReasoning += t;
            deltas++;
            later();
          },
          onContent: (t) => {
            firstTokenAt ??= performance.now();
            pendingContent += t;
            deltas++;
            later();
          },
        },
        controller.signal,
      );
      flush();
      msg.stats = answerStats(result, sentAt, performance.now(), deltas, this.contextLimit(chat));
    } catch (e) {
      flush();
      const err = e instanceof ApiError ? e : new ApiError('server', String(e));
      // Speed of what did arrive; no stats at all when nothing did.
      if (firstTokenAt !== undefined) msg.stats = answerStats({ firstTokenAt }, sentAt, performance.now(), deltas, this.contextLimit(chat));
      if (err.kind === 'aborted') msg.interrupted = 'stopped';
      else {
        msg.interrupted = 'error';
        const f = friendly(err);
        msg.error = { title: f.title, detail: f.detail, retryable: f.retryable };
        if (err.kind === 'unreachable' || err.kind === 'loading') void this.pollHealth();
      }
    } finally {
      msg.streaming = undefined;
      this.controller = null;
      this.streamingChatId = null;
      chat.updatedAt = Date.now();
      await this.persist(chat);
    }
  }

  /** Cancels the answer being streamed (the server stops generating when the connection closes). */
  stop(): void {
    this.controller?.abort();
  }
}

function userMessage(text: string, attachments: Attachment[], images: ImageAttachment[]): UserMessage {
  return {
    role: 'user',
    content: text,
    attachments: attachments.length ? attachments : undefined,
    images: images.length ? images : undefined,
    at: Date.now(),
  };
}

export const store = new Store();
