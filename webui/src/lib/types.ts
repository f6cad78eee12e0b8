/** The data the WebUI keeps in IndexedDB and sends to the API. */

/** A text document attached to a user message; its text goes into the prompt. */
export interface Attachment {
  name: string;
  /** Bytes of the original file. */
  size: number;
  text: string;
}

/** What one answer cost and how fast it came. Missing numbers were not reported. */
export interface AnswerStats {
  promptTokens?: number;
  completionTokens?: number;
  /** Milliseconds from sending to the first reasoning or answer text. */
  ttftMs?: number;
  /** Generated tokens per second after the first token. */
  tokensPerSecond?: number;
  /** Prompt + completion tokens against `contextLimit`. */
  contextUsed?: number;
  contextLimit?: number;
  finishReason?: string;
}

/** An image attached to a user message, sent to the model as an OpenAI `image_url` part with a data URL. */
export interface ImageAttachment {
  name: string;
  /** `image/png`, `image/jpeg`, `image/webp` or `image/gif`, read from the file's first bytes. */
  mime: string;
  /** Bytes of the original file (the data URL is about 4/3 of this). */
  size: number;
  /** Pixels, as the browser decoded the image (absent when it was not decoded). */
  width?: number;
  height?: number;
  /** `data:<mime>;base64,<the file's bytes>`: the image as sent and as stored. */
  dataUrl: string;
}

export interface UserMessage {
  role: 'user';
  content: string;
  attachments?: Attachment[];
  images?: ImageAttachment[];
  at: number;
}

export interface AssistantMessage {
  role: 'assistant';
  content: string;
  reasoning?: string;
  /** Set when the answer was cut: `stopped` by the user, or `error` (then `error` holds the message). */
  interrupted?: 'stopped' | 'error';
  error?: { title: string; detail: string; retryable?: boolean };
  stats?: AnswerStats;
  /** Set while the answer streams; an answer still marked so after a reload was cut by it. */
  streaming?: boolean;
  at: number;
}

export type Message = UserMessage | AssistantMessage;

export type ReasoningEffort = 'low' | 'medium' | 'xhigh';

/** Sampling values; `null` defers to the server's default. */
export interface Sampling {
  temperature: number | null;
  top_p: number | null;
  top_k: number | null;
  min_p: number | null;
}

export interface ChatSettings {
  thinking: boolean;
  /** `null`: the server's default effort. */
  effort: ReasoningEffort | null;
  accuracyLevel: 1 | 2 | 3;
  /** Tokens; `null`: the profile's maximum. */
  contextLength: number | null;
  /** Tokens; `null`: the profile's maximum. */
  prefillLength: number | null;
  sampling: Sampling;
  system: string;
}

export interface Chat {
  id: string;
  title: string;
  createdAt: number;
  updatedAt: number;
  messages: Message[];
  settings: ChatSettings;
}

export function defaultSettings(): ChatSettings {
  return {
    thinking: true,
    effort: null,
    accuracyLevel: 3,
    contextLength: null,
    prefillLength: null,
    sampling: { temperature: null, top_p: null, top_k: null, min_p: null },
    system: '',
  };
}
