"use strict";
// Images attached to the next message: picked with the button, pasted into the prompt or dropped
// on the composer; shown as thumbnails until sent, then in the conversation. They go as data URLs
// in the chat's image_url parts, so a conversation with images runs on /v1/chat/completions.

const attachments = [];  // the next message's images, as data URLs

function attach(files) {
  for (const file of files) {
    if (!file || !file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => {
      attachments.push(reader.result);
      showAttachments();
    };
    reader.readAsDataURL(file);
  }
}

function thumbnail(url) {
  const image = document.createElement("img");
  image.src = url;  // a data URL this page read itself (the CSP allows data: images only)
  image.alt = "attached image";
  image.className = "thumb";
  return image;
}

function showAttachments() {
  const strip = $("attachments");
  strip.replaceChildren(...attachments.map((url, i) => {
    const item = document.createElement("span");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "Remove this image";
    remove.onclick = () => {
      attachments.splice(i, 1);
      showAttachments();
    };
    item.append(thumbnail(url), remove);
    return item;
  }));
  strip.hidden = attachments.length === 0;
}

// The attached images, taken for a message (the strip empties); `back` puts them back.
function takeAttachments() {
  const taken = attachments.splice(0);
  showAttachments();
  return taken;
}

function restoreAttachments(urls) {
  attachments.unshift(...urls);
  showAttachments();
}

// A user turn's content: its images, then its text (the chat API's parts).
function userContent(text, images) {
  if (!images.length) return text;
  return [...images.map((url) => ({type: "image_url", image_url: {url}})), {type: "text", text}];
}

function hasImages(messages) {
  return messages.some((m) => Array.isArray(m.content));
}

function showImages(item, images) {
  if (!images.length) return;
  const strip = document.createElement("span");
  strip.className = "images";
  strip.append(...images.map(thumbnail));
  item.append(strip);
}

function initImages() {
  $("attach").onclick = () => $("image-file").click();
  $("image-file").onchange = (event) => {
    attach(event.target.files);
    event.target.value = "";
  };
  $("prompt").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.items || [])].filter((i) => i.kind === "file").map((i) => i.getAsFile());
    if (files.length) {
      event.preventDefault();
      attach(files);
    }
  });
  const composer = $("composer");
  composer.addEventListener("dragover", (event) => event.preventDefault());
  composer.addEventListener("drop", (event) => {
    event.preventDefault();
    attach(event.dataTransfer?.files || []);
  });
}
