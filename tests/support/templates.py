"""Small chat templates written for the tests, each modelling one behaviour of a real family.

They use Qwen's ChatML markers so that a real Qwen3 tokenizer turns every marker into one token.
"""

# Qwen2.5 style: a default system block when the request has none; tools inside the system turn.
DEFAULT_SYSTEM = """\
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set sys = 'You are a helpful assistant made by Example Corp.' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\n' + sys }}
{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools>' }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for m in rest %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# GLM / Kimi style: tools are rendered before the system text.
TOOLS_FIRST = """\
{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Llama-3.x style: tools go inside the first user turn.
TOOLS_IN_FIRST_USER = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\nCutting Knowledge Date: December 2023\\n\\n' + sys + '<|im_end|>\\n' }}
{%- set first = namespace(done=false) %}
{%- for m in rest %}
{%- if m.role == 'user' and not first.done and tools %}{%- set first.done = true %}
{{- '<|im_start|>user\\nGiven the following functions, respond with a JSON call.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- m.content + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Mistral style: system text and tools move to just before the LAST user message.
BEFORE_LAST_USER = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set sys = none %}{%- set rest = messages %}{%- endif %}
{%- set last = namespace(i=-1) %}
{%- for m in rest %}{%- if m.role == 'user' %}{%- set last.i = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in rest %}
{%- if m.role == 'user' %}
{%- if loop.index0 == last.i and tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- if loop.index0 == last.i and sys %}{{- '[INST]' + sys + '\\n\\n' + m.content + '[/INST]' }}
{%- else %}{{- '[INST]' + m.content + '[/INST]' }}{%- endif %}
{%- elif m.role == 'assistant' %}{{- (m.content or '') + eos_token }}
{%- endif %}
{%- endfor %}"""

# gpt-oss style: a system header with the date and reasoning effort, then the developer message
# (system messages are treated as developer instructions); kwargs reasoning_effort.
DEVELOPER_REASONING = """\
{{- '<|im_start|>system\\nYou are ChatGPT.\\nKnowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: ' + (reasoning_effort | default('medium')) + '<|im_end|>\\n' }}
{%- set dev = namespace(text='') %}
{%- for m in messages %}{%- if m.role in ['system', 'developer'] %}{%- set dev.text = dev.text + m.content + '\\n' %}{%- endif %}{%- endfor %}
{%- if dev.text or tools %}{{- '<|im_start|>developer\\n# Instructions\\n\\n' + dev.text }}
{%- if tools %}{{- '# Tools\\n' }}{%- for t in tools %}{{- '## ' + t.function.name + '\\n' + (t.function.description or '') + '\\n' }}{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}{%- endif %}
{%- for m in messages %}{%- if m.role not in ['system', 'developer'] %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Llama-3.2 style: today's date rendered via strftime_now in the system turn.
TODAYS_DATE = """\
{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\nToday Date: ' + date_string + '\\n\\n' + sys + '<|im_end|>\\n' }}
{%- for m in rest %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Hermes tool_use style: iterates tools without a guard, so it fails on tools=None.
NEEDS_TOOL_LIST = """\
{{- '<|im_start|>system\\n' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}
{%- for m in messages %}{%- if m.role == 'system' %}{{- m.content }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}
{%- for m in messages %}{%- if m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Gemma-2 style: refuses system messages outright.
NO_SYSTEM_ROLE = """\
{%- if messages[0].role == 'system' %}{{- raise_exception('System role not supported') }}{%- endif %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"""

# Content-part lists: text parts concatenated, image parts rendered as a placeholder.
CONTENT_PARTS = """\
{%- macro text(c) %}{%- if c is string %}{{- c }}{%- else %}{%- for p in c %}{%- if p.type == 'text' %}{{- p.text }}{%- else %}{{- '<|image_pad|>' }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + text(m.content) + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Llama-3.1 style: `tools is not none` (not `if tools`) turns on a tool block, so tools=[] and
# tools=None render differently.
TOOLS_NOT_NONE = """\
{{- '<|im_start|>system\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\nYou may call these functions:\\n' }}{%- for t in tools %}{{- (t | tojson) + '\\n' }}{%- endfor %}{%- endif %}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}{{- '<|im_end|>\\n' }}
{%- for m in messages %}{%- if m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Gemma-4 style: a thinking instruction in the system turn when enable_thinking is set (mlx-lm's
# TokenizerWrapper sets it from the vocabulary when the request does not).
THINKING = """\
{{- '<|im_start|>system\\n' }}
{%- if enable_thinking is defined and enable_thinking %}{{- 'Think step by step inside <think> tags before you answer.\\n\\n' }}{%- endif %}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}{{- '<|im_end|>\\n' }}
{%- for m in messages %}{%- if m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# A template that fails on tools=None only for some requests (a `strict` kwarg), and tells None
# from []: the tools fallback must be decided per request, never learned per template.
FAILS_ON_NONE_WHEN_STRICT = """\
{%- if strict is defined and strict %}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{%- endif %}
{{- '<|im_start|>system\\n' }}
{%- if tools is not none %}{{- 'Tools are enabled for this conversation.\\n' }}{%- endif %}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}{{- '<|im_end|>\\n' }}
{%- for m in messages %}{%- if m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

BEHAVIOURS = {
    "default_system": DEFAULT_SYSTEM,
    "tools_first": TOOLS_FIRST,
    "tools_in_first_user": TOOLS_IN_FIRST_USER,
    "before_last_user": BEFORE_LAST_USER,
    "developer_reasoning": DEVELOPER_REASONING,
    "todays_date": TODAYS_DATE,
    "needs_tool_list": NEEDS_TOOL_LIST,
    "content_parts": CONTENT_PARTS,
    "tools_not_none": TOOLS_NOT_NONE,
    "thinking": THINKING,
}


def clock_template(expression: str) -> str:
    """DEFAULT_SYSTEM with ``expression`` printed right after the system text."""
    return DEFAULT_SYSTEM.replace("{{- '<|im_start|>system\\n' + sys }}",
                                  "{{- '<|im_start|>system\\n' + sys + ' ' + " + expression + " }}")


# A system text long enough that a clock printed after it leaves a static prefix worth caching.
LONG_SYSTEM = {"role": "system", "content": "You are the agent of the day; " * 6}
