"""A realistic agent's prompts for the quality benchmark: an operations assistant's system
prompt and 8 tools (the static prefix, the same on every turn), then a user turn that pastes a
document and asks a question whose answer is in it.

Each document is an incident postmortem (~950 tokens): 24 paragraphs of what such reports say, in
a fresh order, with six facts (incident commander, region, component, customers affected, ticket,
duration) each stated once at the end of a random paragraph; the question asks one of them, so the
answer is one short span in the middle of the document: the tokens that matter are few, which is
what SpecPrefill's selection must find. Seeded: the same seed gives the same prompt everywhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = (
    "You are Atlas, the operations assistant of Northwind Cloud. You answer questions from "
    "engineers about services, incidents and runbooks. Read any document the user pastes "
    "carefully and answer from it; quote names, numbers and places exactly as the document "
    "gives them. Keep answers to one short sentence. If the document does not say, answer "
    "that it does not say. Use a tool only when the user asks you to act, never to answer a "
    "question that the pasted document already answers."
)


def _tool(name: str, description: str, properties: dict[str, Any],
          required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def _s(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


TOOLS: list[dict[str, Any]] = [
    _tool("search_runbooks", "Full-text search over the runbook library.",
          {"query": _s("Words to search for."), "limit": {"type": "integer", "default": 5}},
          ["query"]),
    _tool("get_service_status", "Current health, version and error rate of a service.",
          {"service": _s("Service name.")}, ["service"]),
    _tool("page_oncall", "Page the on-call engineer of a service.",
          {"service": _s("Service name."), "reason": _s("Why, in one line.")},
          ["service", "reason"]),
    _tool("open_incident", "Open an incident ticket.",
          {"title": _s("Short title."), "severity": {"type": "string",
                                                     "enum": ["sev1", "sev2", "sev3"]}},
          ["title", "severity"]),
    _tool("rollback_deploy", "Roll a service back to its previous version.",
          {"service": _s("Service name."), "region": _s("Region, or all.")}, ["service"]),
    _tool("query_metrics", "Run a PromQL query over the last hours.",
          {"promql": _s("The query."), "hours": {"type": "integer", "default": 1}},
          ["promql"]),
    _tool("fetch_logs", "Recent log lines of a service, newest first.",
          {"service": _s("Service name."), "grep": _s("Only lines containing this.")},
          ["service"]),
    _tool("send_message", "Send a chat message to a team channel.",
          {"channel": _s("Channel name."), "text": _s("Message text.")}, ["channel", "text"]),
]

PEOPLE = ["Maria Lopez", "Kenji Watanabe", "Aisha Bello", "Tomasz Nowak", "Priya Raman",
          "Lucas Moreau", "Ingrid Solberg", "Daniel Okafor", "Chloe Martin", "Ravi Iyer",
          "Elena Petrova", "Samuel Reyes", "Hannah Becker", "Omar Haddad", "Yuki Tanaka"]
REGIONS = ["Frankfurt", "Dublin", "Oregon", "Virginia", "Singapore", "Tokyo", "Sydney",
           "Montreal", "Stockholm", "Mumbai", "Seoul", "Johannesburg"]
COMPONENTS = ["load balancer", "payment gateway", "message queue", "search cluster",
              "session store", "image cache", "DNS resolver", "billing database"]

# (fact sentence, question, answer field): each report states every fact once.
FACTS = [
    ("The incident commander was {person}.", "Who was the incident commander?", "person"),
    ("Only the {region} region was affected; every other region kept serving traffic.",
     "Which region was affected?", "region"),
    ("The root cause was an expired TLS certificate on the {component}.",
     "Which component had the expired certificate?", "component"),
    ("In total, {customers} customers saw failed checkouts during the outage.",
     "How many customers saw failed checkouts?", "customers"),
    ("The follow-up work is tracked in ticket {ticket}.",
     "Which ticket tracks the follow-up work?", "ticket"),
    ("The outage lasted {minutes} minutes from the first alert to full recovery.",
     "How many minutes did the outage last?", "minutes"),
]

# Paragraphs around the facts: what such a report says that no question asks about.
FILLER = [
    "The on-call engineer acknowledged the first page within four minutes and opened the "
    "incident channel. Dashboards showed error rates climbing on the public API while latency "
    "stayed flat, which pointed away from a capacity problem.",
    "A rollback of the most recent deploy was tried first, because most incidents of the past "
    "quarter followed a deploy. It changed nothing, and the team moved on to the network path.",
    "Customer support received a wave of tickets about declined orders. The support lead "
    "posted a holding reply on the status page and kept it updated every fifteen minutes.",
    "Synthetic checks from three continents confirmed the failures. Internal traffic between "
    "services was healthy throughout, so the batch jobs and the reporting pipeline kept running.",
    "Engineers compared the configuration of healthy and failing hosts and found no "
    "difference in the application settings. The search then turned to certificates and keys.",
    "Once the cause was known, the fix itself took a few minutes: a new certificate was issued, "
    "deployed to every host behind the affected endpoint and verified with a test transaction.",
    "The monitoring system had warned about the certificate thirty days earlier, but the "
    "warning went to a mailing list that nobody had read since a team reorganisation.",
    "During recovery, queued requests were replayed in order. No payment was charged twice, "
    "which the finance team confirmed the next morning by reconciling the ledgers.",
    "The review meeting was blameless and took place two days later. Everyone who was paged "
    "attended, along with the product owner of checkout and a representative of support.",
    "Action items include alerting on certificate expiry through the paging system, an owner "
    "for every certificate in the inventory, and a quarterly drill for certificate rotation.",
    "Communication worked well: the status page was updated within ten minutes of the first "
    "alert, and large customers were contacted directly by their account managers.",
    "Capacity was not a factor. CPU and memory on every tier stayed below half of their limits, "
    "and autoscaling did not add or remove a single instance during the incident.",
    "The timeline was reconstructed from the incident channel, the deploy log and the audit "
    "trail of the certificate authority, and every entry was checked by two people.",
    "Some mobile clients kept retrying for a long time after recovery because their backoff "
    "had no upper bound; the mobile team will cap it in the next release.",
    "The first hypothesis was a bad database migration, since one had run that morning. The "
    "migration log showed it had finished cleanly an hour before the first error.",
    "A second engineer joined after twenty minutes to take over communication, so that the "
    "people debugging could stay focused on the failing requests.",
    "Error budgets for the quarter were exhausted by this incident alone. Feature launches for "
    "checkout are frozen until the reliability work below is done.",
    "Several teams asked why the staging environment had not caught the problem. Staging uses "
    "certificates from an internal authority with a much longer lifetime, so it never expires there.",
    "The runbook for certificate problems was out of date: it named a tool that had been "
    "retired and a dashboard that no longer existed. It has since been rewritten.",
    "Partners that call the public API were told about the outage through the partner portal, "
    "and two of them asked for a written summary, which this document will serve as.",
    "Traffic shifted to the remaining healthy endpoints on its own, but only for clients that "
    "resolve the endpoint again on every connection, which most browsers do not.",
    "The security team reviewed the incident and found no sign of tampering: the certificate "
    "had simply reached the end of its validity period on schedule.",
    "Logs from the edge proxies showed handshake failures from the first minute. They were not "
    "searched earlier because the alert message did not mention the edge at all.",
    "After the incident, an inventory of all certificates found eleven more that would expire "
    "within ninety days. All of them have been renewed and added to the new expiry alert.",
]


# The question first and again after the document: how people ask, and what a 135M model
# needs to answer at all (asked only after the document, it mostly summarizes instead).
USER_TURN = "{question} Answer from this postmortem:\n\n{text}\n\nQuestion: {question}"


@dataclass(frozen=True)
class AgentPrompt:
    """One turn: the chat messages and tools, and the answer the document gives."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    answer: str
    question: str


def incident_report(rng: random.Random, filler: int) -> tuple[str, dict[str, str]]:
    """A postmortem: ``filler`` paragraphs with the facts spread among them, and the facts."""
    values = {"person": rng.choice(PEOPLE), "region": rng.choice(REGIONS),
              "component": rng.choice(COMPONENTS), "customers": str(rng.randrange(120, 9800)),
              "ticket": f"OPS-{rng.randrange(1000, 9999)}", "minutes": str(rng.randrange(17, 190))}
    paragraphs = rng.sample(FILLER, filler)
    for sentence, _, _ in FACTS:  # each fact at the end of a random paragraph
        i = rng.randrange(len(paragraphs))
        paragraphs[i] = paragraphs[i] + " " + sentence.format(**values)
    title = f"# Postmortem: checkout outage of {rng.choice(['March', 'June', 'September'])} " \
            f"{rng.randrange(2, 28)}"
    return title + "\n\n" + "\n\n".join(paragraphs), values


def agent_prompt(seed: int, filler: int = 24) -> AgentPrompt:
    """The agent turn number ``seed``: a fresh report and a question on one of its facts."""
    rng = random.Random(seed)
    text, values = incident_report(rng, filler)
    _, question, field = FACTS[seed % len(FACTS)]
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": USER_TURN.format(text=text, question=question)}]
    return AgentPrompt(messages, TOOLS, values[field], question)


# -- static-prefix fidelity: questions whose answer lives in the system prompt ----------------

# Tuned on dense alone until SmolLM2-135M answers most turns (bench/README.md, "Static-prefix
# fidelity"): it copies a distinctive value (an upper-case word, a number, an address) stated
# once in the system prompt across the ~700 tool tokens and the pasted document, but not a
# plain-word channel or a person's name, nor a tool's name from its description (dense was
# right on 1 of 34 and 0 of 18 such turns over the phrasings tried), so the facts are of the
# first kind. The agent's usual "answer from the document" instruction is left out: with it
# the model answers from the postmortem whatever the question.
FIDELITY_SYSTEM = (
    "You are Atlas, the operations assistant of Northwind Cloud. You help engineers with "
    "services, incidents and runbooks. Keep answers to one short sentence."
)
# (the house fact, stated once at the end of the system prompt; the question; its values)
HOUSE_FACTS: list[tuple[str, str, list[str]]] = [
    ("The team's code word is {value}.", "What is the team's code word?",
     ["PELICAN", "MARIGOLD", "TANGERINE", "COBALT", "NIGHTINGALE", "JUNIPER", "SAFFRON",
      "GRANITE"]),
    ("The staging server is called {value}.", "What is the staging server called?",
     ["ORION", "VEGA", "ALTAIR", "RIGEL", "DENEB", "CAPELLA"]),
    ("The emergency phone number is {value}.", "What is the emergency phone number?",
     ["555-0147", "555-0193", "555-0122", "555-0168", "555-0135"]),
]
STATIC_TURN = "Here is a postmortem:\n\n{text}\n\n{question}"


def static_prompt(seed: int, filler: int = 12) -> AgentPrompt:
    """Turn ``seed`` of the fidelity workload: the agent's tools and a system prompt stating one
    house fact (its kind and value picked by the seed), a fresh postmortem pasted (``filler``
    paragraphs, ~500 tokens: half the quality benchmark's, for a shared 2-core machine), and a
    question that only the system prompt answers (the document never says)."""
    rng = random.Random(10_000 + seed)
    fact, question, values = HOUSE_FACTS[seed % len(HOUSE_FACTS)]
    value = rng.choice(values)
    text, _ = incident_report(rng, filler)
    messages = [{"role": "system", "content": FIDELITY_SYSTEM + " " + fact.format(value=value)},
                {"role": "user", "content": STATIC_TURN.format(text=text, question=question)}]
    return AgentPrompt(messages, TOOLS, value, question)
